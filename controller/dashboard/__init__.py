"""The operators' dashboard (its own issue): a page served by the controller's HTTP server that
renders the core's read model (``ControllerCore.snapshot``) and the decision log, like the JSON
views in ``controller.server.views`` do today.
"""
