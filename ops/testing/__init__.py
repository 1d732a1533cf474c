"""Fault and soak tooling: the cluster a fault run owns, its fault proxy, the invariant checker."""
