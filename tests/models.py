from django.db import models


class Poll(models.Model):
    """A model whose instances the cache tests store and read back."""

    question = models.CharField(max_length=200)
    answers = models.IntegerField(default=0)

    class Meta:
        app_label = "tests"


class FencedRecord(models.Model):
    """A resource a lock protects, with the fencing token of its last write beside it
    (``django_kvcache.locks.fenced_update``)."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)
    fencing_token = models.BigIntegerField(null=True)

    class Meta:
        app_label = "tests"
