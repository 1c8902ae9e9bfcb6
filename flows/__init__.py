"""Orchestration only: Prefect flows and tasks that chain the stage programs, passing URIs and small JSON."""
