"""What the engine does with a policy, pure (no vLLM, no torch, no network): the plugin
(``specpilot.engine_plugin.pilot``) and the simulator (``benchmarks.sim.specpilot_policy``) drive
these same objects, so the simulator differs from the plugin only in the engine it simulates.

- ``points``: a request's fixed point in [0, 1) (one hash for probes and counterfactual picks).
- ``view``: the policy in force and its lookup per batch size (``PolicyView``, ``PolicyLookup``).
- ``compose``: the per-step re-pick of settled classes' arms (``StepComposer``).
- ``step``: one step's choice per request (lookup, probes, re-picks, drafts allowed).
- ``picks``: which requests a step scores counterfactually (``CounterfactualPicks``).
- ``stats``: the per-step counts of one report interval (``StatsAggregator``).
"""
