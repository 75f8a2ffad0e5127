"""Enrolled devices that run edgepfl's own agent with one behaviour changed: what an attacker
holding one device's bundle can do without writing a client of its own. Each module runs as
``python -m tests.hostile_agents.<name> --config agent.yaml``."""
