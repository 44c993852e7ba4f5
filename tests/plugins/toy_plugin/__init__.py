"""A plug-in from outside areal, installed as its own distribution by the tests
(tests/plugins/dist.py): a scheduler (scheduler.py) and a registry (registry.py), found
through the entry points of its dist-info only."""
