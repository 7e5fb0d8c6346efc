"""No models: this module makes Django send ``pre_migrate`` for django_kvcache, whose
receiver creates the MySQLCache tables before migrations run (``apps.py``)."""
