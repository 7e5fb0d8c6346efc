project = "django-kvcache"
author = "django-kvcache developers"
release = "0.1.0"
extensions: list[str] = []
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
