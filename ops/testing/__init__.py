"""Fault and soak tooling: the cluster a fault run owns, its fault proxy, a
replicated PostgreSQL pair, the invariant checker."""
