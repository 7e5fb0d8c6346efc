"""Generators of the values sites cache: HTML fragments, JSON responses, pickled rows...

Each generator takes a ``random.Random`` and a target size in bytes and returns one value.
The text is built to compress like the real thing, not better: words come from a
vocabulary of a few thousand, drawn with a Zipf-like distribution (a few words very
often, most rarely), and the markup carries what makes real pages and responses less
repetitive than a template loop: ids, prices, dates, slugs, hashes in URLs, many
class names. Measured with zlib level 6 (``compression_ratio``): HTML 2.4x at 1 KB and
4.1x at 4 KB (rendered pages: 2.6x at 1 KB, 3-5x larger), JSON 1.9x and 2.6x, pickled
rows, whose bulk is numbers, dates and short strings, 1.55x and 2.0x. A generator
repeating a small vocabulary in one template would compress far better and flatter
compression.
"""
from __future__ import annotations

import datetime
import itertools
import json
import math
import pickle
import random
import string
import zlib
from decimal import Decimal
from functools import lru_cache
from typing import Any, Callable, Sequence

#: The words every text uses most, most frequent first (they head the Zipf ranking).
COMMON_WORDS = (
    "the of and to a in is for on with that this by from at as your are be or it new all "
    "more our an will can about has not have you we one their which free us its get see "
    "de home page search time other these was if but than into also may out best use"
).split()
GENERATED_WORDS = 4000
VOCABULARY_SEED = 20261122  # the vocabulary is fixed; only the values depend on --seed
ZIPF_EXPONENT = 1.2
SYLLABLES = ["er", "in", "on", "an", "re", "st", "th", "en", "at", "es", "ti", "or", "te", "al", "ar",
             "le", "ch", "ou", "ing", "ion", "ent", "ter"] + [
    consonant + vowel for consonant in "tnsrldcmpbgfhvwkjz" for vowel in "eaoiu"]


@lru_cache(maxsize=1)
def vocabulary() -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The words and their cumulative Zipf weights (for ``random.choices``)."""
    rng = random.Random(VOCABULARY_SEED)
    syllable_weights = [1 / (rank + 1) for rank in range(len(SYLLABLES))]  # some sounds are common
    words = list(COMMON_WORDS)
    seen = set(words)
    while len(words) < len(COMMON_WORDS) + GENERATED_WORDS:
        word = "".join(rng.choices(SYLLABLES, syllable_weights, k=rng.choice((1, 2, 2, 3, 3, 4))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(len(words))]
    return tuple(words), tuple(itertools.accumulate(weights))


def words(rng: random.Random, count: int) -> list[str]:
    vocab, cumulative = vocabulary()
    return rng.choices(vocab, cum_weights=cumulative, k=count)


def sentence(rng: random.Random, low: int = 4, high: int = 16) -> str:
    text = " ".join(words(rng, rng.randint(low, high)))
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


def title(rng: random.Random, low: int = 2, high: int = 6) -> str:
    return " ".join(word.capitalize() for word in words(rng, rng.randint(low, high)))


def slug(rng: random.Random, low: int = 2, high: int = 5) -> str:
    return "-".join(words(rng, rng.randint(low, high)))


def hex_token(rng: random.Random, length: int) -> str:
    return "".join(rng.choices("0123456789abcdef", k=length))


def moment(rng: random.Random) -> datetime.datetime:
    """An aware UTC datetime within the last few years, as Django hands them out."""
    start = datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone.utc)
    return start + datetime.timedelta(seconds=rng.randrange(5 * 365 * 86400),
                                      microseconds=rng.randrange(1_000_000))


def price(rng: random.Random) -> Decimal:
    return Decimal(f"{rng.randint(1, 2000)}.{rng.randint(0, 99):02d}")


COMPONENTS = ("card", "product", "teaser", "list", "media", "post", "comment", "order", "grid",
              "tile", "panel", "entry", "review", "listing", "result", "feature", "promo", "row")
ELEMENTS = ("title", "body", "meta", "link", "image", "thumb", "price", "footer", "header",
            "author", "date", "badge", "text", "actions", "summary")


@lru_cache(maxsize=1)
def class_names() -> tuple[str, ...]:
    """A site's CSS classes: framework utilities plus BEM-style components of its own."""
    utilities = [f"{prefix}-{size}" for prefix in ("col-md", "col-sm", "mt", "mb", "px", "py", "gap")
                 for size in range(1, 7)]
    blocks = [f"{component}{suffix}" for component in COMPONENTS for suffix in ("", "-item", "-list")]
    elements = [f"{component}__{element}" for component in COMPONENTS for element in ELEMENTS]
    return tuple(utilities + blocks + elements + ["active", "muted", "btn", "btn-primary",
                                                  "text-end", "d-flex", "badge", "card"])


def classes(rng: random.Random) -> str:
    return " ".join(rng.sample(class_names(), rng.randint(1, 3)))


# --- HTML -----------------------------------------------------------------------------------

class Style:
    """The classes one template gives its elements: fixed within a fragment, with the odd
    state modifier, as a ``{% for %}`` loop renders them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        component = rng.choice(COMPONENTS)
        self.fixed = [f"{component} {classes(rng)}", *(
            f"{component}__{element}" + (f" {classes(rng)}" if rng.random() < 0.3 else "")
            for element in rng.sample(ELEMENTS, 5))]

    def __getitem__(self, index: int) -> str:
        extra = self.rng.random() < 0.15
        return f"{self.fixed[index]} {self.rng.choice(STATES)}" if extra else self.fixed[index]


BLOCK_SWITCH = 0.1  # chance that the next block starts another section
STATES = ("active", "muted", "is-new", "sold-out", "highlight")


def _product_card(rng: random.Random, css: Style) -> str:
    pk, name = rng.randint(1, 99999), title(rng)
    return (
        f'    <div class="{css[0]}" data-id="{pk}">\n'
        f'      <a href="/shop/{slug(rng)}-{pk}/" class="{css[1]}">\n'
        f'        <img src="/media/cache/{hex_token(rng, 2)}/{hex_token(rng, 2)}/{hex_token(rng, 12)}.jpg"'
        f' alt="{name}" width="240" height="180" loading="lazy">\n'
        f'      </a>\n'
        f'      <h3 class="{css[2]}">{name}</h3>\n'
        f'      <p class="{css[3]}">{sentence(rng, 4, 14)}</p>\n'
        f'      <div class="{css[4]}">\n'
        f'        <span class="price">&euro;{price(rng)}</span>\n'
        f'        <span class="{css[5]}">{rng.randint(0, 500)} in stock</span>\n'
        f'      </div>\n'
        f'      <form method="post" action="/cart/add/{pk}/">\n'
        f'        <button type="submit" class="btn btn-primary">Add to cart</button>\n'
        f'      </form>\n'
        f'    </div>\n'
    )


def _article_teaser(rng: random.Random, css: Style) -> str:
    when = moment(rng).replace(microsecond=0)
    return (
        f'    <article class="{css[0]}" id="post-{rng.randint(1, 999999)}">\n'
        f'      <h2 class="{css[1]}"><a href="/{when:%Y/%m}/{slug(rng, 3, 7)}/">{title(rng, 3, 9)}</a></h2>\n'
        f'      <p class="{css[2]}">By <a href="/authors/{words(rng, 1)[0]}/">{title(rng, 2, 2)}</a>'
        f' on <time datetime="{when.isoformat()}">{when:%d %b %Y}</time>'
        f' &middot; {rng.randint(0, 350)} comments</p>\n'
        f'      <p class="{css[3]}">{" ".join(sentence(rng) for _ in range(rng.randint(1, 4)))}</p>\n'
        f'      <a class="{css[4]}" href="/{when:%Y/%m}/#comments" aria-label="Read more">Read more</a>\n'
        f'    </article>\n'
    )


def _table_row(rng: random.Random, css: Style) -> str:
    when, number = moment(rng), rng.randint(10000, 999999)
    return (
        f'      <tr class="{css[0]}">\n'
        f'        <td><a href="/orders/{number}/">#{number}</a></td>\n'
        f'        <td class="{css[1]}">{title(rng, 1, 3)}</td>\n'
        f'        <td>{when:%Y-%m-%d %H:%M}</td>\n'
        f'        <td class="text-end">{price(rng)}</td>\n'
        f'        <td><span class="{css[2]}">{rng.choice(("paid", "open", "shipped", "refunded"))}'
        f'</span></td>\n'
        f'      </tr>\n'
    )


def _comment(rng: random.Random, css: Style) -> str:
    return (
        f'    <li class="{css[0]}" id="c{rng.randint(1, 9999999)}">\n'
        f'      <img class="{css[1]}" src="/media/avatars/{hex_token(rng, 12)}.png" alt="">\n'
        f'      <b class="{css[2]}">{words(rng, 1)[0]}{rng.randint(1, 999)}</b>\n'
        f'      <p class="{css[3]}">{sentence(rng, 3, 18)}</p>\n'
        f'      <a class="{css[4]}" href="#reply" data-action="reply">Reply</a>\n'
        f'    </li>\n'
    )


HTML_BLOCKS: tuple[Callable[[random.Random, Style], str], ...] = (
    _product_card, _article_teaser, _table_row, _comment)


def html_fragment(rng: random.Random, size: int, max_size: int | None = None) -> str:
    """Rendered template output of exactly ``size`` characters (ASCII, so also bytes).

    Blocks of one kind repeat (a product grid, an article list, a table, a comment
    thread), as in a page section, now and then another section starts, and lines left
    blank by template tags stay, as Django renders them; the fragment is cut at ``size``.
    """
    block, css = rng.choice(HTML_BLOCKS), Style(rng)
    parts = [f'<section class="{classes(rng)}">\n  <div class="{classes(rng)}">\n']
    length = len(parts[0])
    while length < size:
        if rng.random() < BLOCK_SWITCH:  # a page has several sections
            block, css = rng.choice(HTML_BLOCKS), Style(rng)
        part = block(rng, css).replace("\n", "\n" + " " * 6 + "\n", rng.randint(0, 2))
        parts.append(part)
        length += len(part)
    return "".join(parts)[:size]


# --- JSON -----------------------------------------------------------------------------------

def _api_object(rng: random.Random) -> dict[str, Any]:
    pk, created = rng.randint(1, 999999), moment(rng)
    return {
        "id": pk,
        "uuid": f"{hex_token(rng, 8)}-{hex_token(rng, 4)}-4{hex_token(rng, 3)}-"
                f"{hex_token(rng, 4)}-{hex_token(rng, 12)}",
        "url": f"https://api.example.com/v1/items/{pk}/",
        "name": title(rng),
        "slug": slug(rng),
        "status": rng.choice(("draft", "published", "archived")),
        "price": str(price(rng)),
        "currency": rng.choice(("EUR", "USD", "GBP")),
        "stock": rng.randint(0, 100),
        "rating": round(rng.uniform(1, 5), 1),
        "is_featured": rng.random() < 0.2,
        "created": created.isoformat().replace("+00:00", "Z"),
        "modified": (created + datetime.timedelta(seconds=rng.randrange(10**7))).isoformat()
                    .replace("+00:00", "Z"),
        "owner": {"id": rng.randint(1, 300), "username": f"{words(rng, 1)[0]}{rng.randint(1, 99)}",
                  "avatar": None if rng.random() < 0.3 else f"/media/avatars/{hex_token(rng, 12)}.png"},
        "tags": words(rng, rng.randint(0, 4)),
        "description": sentence(rng, 5, 30),
    }


def _grown(make_item: Callable[[random.Random], Any], render: Callable[[list[Any]], Any],
           rng: random.Random, size: int, max_size: int) -> list[Any]:
    """Items until ``render(items)`` reaches ``size`` bytes, less the last if that passes
    ``max_size`` (items are small next to the ranges, so the result stays in range)."""
    items = [make_item(rng)]
    while len(render(items)) < size:
        items.append(make_item(rng))
    if len(items) > 1 and len(render(items)) > max_size:
        items.pop()
    return items


def _api_page(items: list[dict[str, Any]], page: int = 2) -> str:
    """A paginated list response as Django REST framework renders it (compact JSON)."""
    body = {"count": 4000 + page * 7, "next": f"https://api.example.com/v1/items/?page={page + 1}",
            "previous": f"https://api.example.com/v1/items/?page={page - 1}", "results": items}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def json_response(rng: random.Random, size: int, max_size: int | None = None) -> str:
    """The JSON text of an API response of about ``size`` bytes, at most ``max_size``."""
    page = rng.randint(2, 60)
    items = _grown(_api_object, lambda found: _api_page(found, page), rng, size, max_size or size)
    return _api_page(items, page)


# --- pickled rows ---------------------------------------------------------------------------

ROW_FIELDS = ("id", "title", "slug", "status", "author_id", "category_id", "price", "stock",
              "is_published", "created_at", "updated_at", "parent_id")


def _row(rng: random.Random) -> dict[str, Any]:
    created = moment(rng)
    values = (
        rng.randint(1, 99999), title(rng, 2, 5), slug(rng), rng.choice(("draft", "live", "hidden")),
        rng.randint(1, 200), rng.randint(1, 12), price(rng), rng.randint(0, 100),
        rng.random() < 0.8, created, created + datetime.timedelta(seconds=rng.randrange(10**7)),
        None if rng.random() < 0.7 else rng.randint(1, 999999),
    )
    return dict(zip(ROW_FIELDS, values))  # one key object per field, as QuerySet.values() gives


def row_list(rng: random.Random, size: int, max_size: int | None = None) -> list[dict[str, Any]]:
    """``list(queryset.values())``: rows whose pickle is about ``size`` bytes."""
    return _grown(_row, stored_bytes, rng, size, max_size or size)


# --- small scalars and incompressible bytes ---------------------------------------------------

def scalar(rng: random.Random, size: int = 0, max_size: int | None = None) -> int | str:
    """A counter, an id, a flag or a short string: what ``cache.set(key, 42)`` stores."""
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randint(0, 10 ** rng.randint(1, 9))
    if choice == 1:
        return rng.choice(("ok", "1", "yes", "pending", "done"))
    if choice == 2:
        return f"{words(rng, 1)[0]}:{rng.randint(1, 99999)}:{rng.choice(string.ascii_lowercase)}"
    return slug(rng, 1, 3)


def random_bytes(rng: random.Random, size: int, max_size: int | None = None) -> bytes:
    """Incompressible bytes, like an image thumbnail or a token."""
    return rng.randbytes(size)


def alphanumeric(rng: random.Random, size: int, max_size: int | None = None) -> str:
    """Letters and digits at random, like a token, a hash list or an encoded id:
    compressible only by about a quarter (62 symbols in 8-bit characters)."""
    return "".join(rng.choices(string.ascii_letters + string.digits, k=size))


Generator = Callable[..., Any]
#: kind -> generator(rng, size, max_size)
GENERATORS: dict[str, Generator] = {
    "html": html_fragment,
    "json": json_response,
    "rows": row_list,
    "scalar": scalar,
    "bytes": random_bytes,
    "text": alphanumeric,
}


def stored_bytes(value: Any) -> bytes:
    """The bytes a cache would compress: UTF-8 text, raw bytes, or the pickle of the rest."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def payload_size(value: Any) -> int:
    return len(stored_bytes(value))


def compression_ratio(values: Sequence[Any], level: int = 6) -> float:
    """Total size over total zlib-compressed size (one ``zlib.compress`` per value)."""
    raw = sum(payload_size(value) for value in values)
    packed = sum(len(zlib.compress(stored_bytes(value), level)) for value in values)
    return round(raw / packed, 2) if packed else math.nan
