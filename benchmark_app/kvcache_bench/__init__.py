"""``manage.py kvcache_benchmark``: django-kvcache's backends against the alternatives."""
