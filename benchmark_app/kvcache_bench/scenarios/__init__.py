"""The benchmark's scenarios; each module has a ``run(context) -> dict`` function."""
