"""Scaling: capacity arithmetic and the pool autoscaler built on it."""
