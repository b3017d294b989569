"""The operators' dashboard: a page served by the controller's HTTP server (``routes``) that
renders the core's read model through the policy API's own JSON, follows decisions live and
takes overrides with the policy token (docs/architecture.md, "The dashboard")."""
