"""The state-store edge (the fleet issue): where the server flushes the core's state and loads it
back from. The core keeps all state in its own objects; a store only ever sees what the core's
read model (``ControllerCore.snapshot``) and its evidence exports hand it. Today state lives in
memory only, in the core.
"""
