"""Copy-heavy texts built by a seeded generator: later passages repeat earlier ones verbatim, as
in the prompts long-context users send (contracts whose clauses recur, logs, retrieved passages,
few-shot examples). A sparse plan calibrated on plain prose can miss the far block a repeat
copies from, so these are a kind of their own in :data:`sparseflow.texts.TEXTS`.

Only the standard library's ``random.Random`` with a fixed seed is used: the same text on every
run and machine (the clause text varies with the Python version like the prose it is cut from).
"""

from __future__ import annotations

import random
from typing import Iterator, List, Sequence

# Every generator stops once the text has this many characters: more than 128K SmolLM2 tokens
# (about 3.5-4.5 characters a token on these texts), so the long-context checks can use them.
COPY_CHARS = 640_000


def passages(text: str, min_chars: int = 400) -> List[str]:
    """``text`` cut at blank lines into passages of at least ``min_chars`` characters (consecutive
    paragraphs joined: a grammar rule or a code line alone is too short to be a clause)."""
    out: List[str] = []
    cur: List[str] = []
    for para in text.split("\n\n"):
        if para.strip():
            cur.append(para)
        if sum(len(p) for p in cur) >= min_chars:
            out.append("\n\n".join(cur))
            cur = []
    if cur:
        out.append("\n\n".join(cur))
    return out


def clauses(source: Sequence[str], n_chars: int = COPY_CHARS, seed: int = 51, repeat: float = 0.5) -> str:
    """Numbered sections whose bodies are ``source`` passages in order, each section with
    probability ``repeat`` (from the second on, or once ``source`` runs out) a verbatim copy of an
    earlier section's body picked uniformly: boilerplate clauses that recur anywhere later."""
    if not 0.0 <= repeat < 1.0:
        raise ValueError(f"repeat must be in [0, 1), got {repeat!r}")
    if not source:
        raise ValueError("source must hold at least one passage")
    rng = random.Random(seed)
    fresh: Iterator[str] = iter(source)
    used: List[str] = []
    parts: List[str] = []
    size = 0
    while size < n_chars:
        body = None
        if not used or rng.random() >= repeat:
            body = next(fresh, None)
            if body is not None:
                used.append(body)
        if body is None:
            body = rng.choice(used)
        parts.append(f"Section {len(parts) + 1}.\n\n{body}")
        size += len(parts[-1]) + 2
    return "\n\n".join(parts)


# A made-up web service's log: request lines whose fields vary, and blocks that recur verbatim
# (the same few tracebacks on every error, the same configuration dump at every restart).
_SERVICES = ("gateway", "auth", "orders", "billing", "search", "inventory", "mailer")
_PATHS = ("/v1/orders/{n}", "/v1/users/{n}/profile", "/v1/cart/{n}/items", "/v1/search?q=item{n}", "/v1/invoices/{n}")
_FRAMES = (
    ("app/http/server.py", "handle", "response = route.call(request)"),
    ("app/http/routing.py", "call", "return self.view(request, **params)"),
    ("app/orders/views.py", "create_order", "order = service.place(cart, user)"),
    ("app/orders/service.py", "place", "self.billing.charge(user.account, cart.total)"),
    ("app/billing/client.py", "charge", "reply = self.session.post(url, json=payload, timeout=5)"),
    ("app/db/pool.py", "acquire", "conn = self._queue.get(timeout=self.timeout)"),
    ("app/search/index.py", "query", "hits = self.backend.search(terms, limit=limit)"),
    ("app/cache/redis.py", "get", "raw = self.client.get(self.prefix + key)"),
)
_ERRORS = (
    "TimeoutError: timed out after 5.0 s waiting for billing",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "KeyError: 'shipping_address'",
    "ValueError: cart total must be positive, got -3.50",
    "queue.Empty: no free database connection within 2.0 s",
)


def _traceback(rng: random.Random) -> str:
    frames = sorted(rng.sample(range(len(_FRAMES)), 4))
    lines = ["Traceback (most recent call last):"]
    for i in frames:
        path, func, stmt = _FRAMES[i]
        lines += [f'  File "/srv/{path}", line {rng.randint(20, 900)}, in {func}', f"    {stmt}"]
    return "\n".join(lines + [rng.choice(_ERRORS)])


def _config(rng: random.Random) -> str:
    keys = ("workers", "db.pool_size", "db.timeout_s", "cache.ttl_s", "billing.retries", "search.limit")
    return "\n".join(f"    {k} = {rng.randint(2, 64)}" for k in keys)


def log(n_chars: int = COPY_CHARS, seed: int = 51) -> str:
    """A service log of at least ``n_chars`` characters: request lines whose fields vary (time,
    level, service, request id, user, method, path, status, latency); retries, which repeat one of
    the last 50 request lines verbatim after a new time; on every error one of six tracebacks, on
    every restart the one configuration block, each verbatim."""
    from datetime import datetime, timedelta, timezone

    rng = random.Random(seed)
    traces = [_traceback(rng) for _ in range(6)]
    config = _config(rng)
    start, ms = datetime(2026, 1, 5, 8, 0, tzinfo=timezone.utc), 0
    lines: List[str] = []
    recent: List[str] = []  # the last request lines, without their time: what a retry repeats
    size = 0
    while size < n_chars:
        ms += rng.randint(1, 400)  # integer steps: no float rounding to differ between machines
        ts = (start + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        svc, r = rng.choice(_SERVICES), rng.random()
        if r < 0.01:
            block = f"{ts} INFO  {svc} restarting with configuration:\n{config}"
        elif r < 0.08:
            block = f"{ts} ERROR {svc} request req-{rng.getrandbits(32):08x} failed\n{rng.choice(traces)}"
        elif r < 0.2 and recent:
            block = f"{ts} {rng.choice(recent)} (retry)"
        else:
            recent = (recent + [_request(rng, svc, warn=r < 0.28)])[-50:]
            block = f"{ts} {recent[-1]}"
        lines.append(block)
        size += len(block) + 1
    return "\n".join(lines)


def _request(rng: random.Random, svc: str, warn: bool) -> str:
    level, status = ("WARN ", rng.choice((404, 429, 503))) if warn else ("INFO ", rng.choice((200, 201, 204)))
    path = rng.choice(_PATHS).format(n=rng.randint(1000, 99999))
    method = rng.choice(("GET", "GET", "GET", "POST", "PUT", "DELETE"))
    return (
        f"{level} {svc} req-{rng.getrandbits(32):08x} user={rng.randint(100, 9999)} "
        f"{method} {path} {status} {rng.randint(1, 2500)}ms"
    )
