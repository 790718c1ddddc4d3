"""Base models, adapters and their revisions (filled in by the lifecycle work)."""
