"""Serving-layer tests (Ray Serve + HTTP); one session-scoped cluster in conftest.py."""
