"""Dashboard views: server-rendered pages, small live fragments, and forms that call the services."""
