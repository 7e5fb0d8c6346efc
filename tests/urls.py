from django.http import HttpRequest, HttpResponse
from django.urls import path

from django_kvcache.backends.mysql import MySQLCache


def mysql_cache_view(request: HttpRequest, alias: str, key: str) -> HttpResponse:
    """Writes ``key`` (its value: the request's ``value`` parameter) in a MySQLCache on
    the database ``alias``, and answers what the cache reads back: a view a live server
    runs in a thread of its own (tests/test_mysql_connections.py)."""
    cache = MySQLCache("kvcache_test", {"OPTIONS": {"DATABASE": alias, "CULL_PROBABILITY": 0}})
    cache.set(key, request.GET["value"])
    return HttpResponse(str(cache.get(key)))


urlpatterns: list = [path("mysql-cache/<str:alias>/<str:key>", mysql_cache_view)]
