from django.db import models


class Poll(models.Model):
    """A model whose instances the cache tests store and read back."""

    question = models.CharField(max_length=200)
    answers = models.IntegerField(default=0)

    class Meta:
        app_label = "tests"
