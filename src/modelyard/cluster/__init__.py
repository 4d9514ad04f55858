"""Past one machine: the node side of a Ray cluster (node_agent.py); the front's side is
front/engines/ray_provider.py, and what both say to each other is wire/cluster.py."""
