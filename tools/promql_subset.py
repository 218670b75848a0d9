"""``PromQLSubset``: the few PromQL forms kvplane's Grafana dashboard uses, parsed and evaluated
over a handful of ``/metrics`` scrapes (no Prometheus server here).

Grammar (anything else is refused with :class:`UnsupportedQuery`, naming the query)::

    expr      := term [ "/" term ]
    term      := "sum" [ "by" "(" label { "," label } ")" ] "(" inner ")"
               | "histogram_quantile" "(" number "," term ")"
               | inner
    inner     := "rate" "(" selector "[" duration "]" ")" | selector
    selector  := metric [ "{" label ("=" | "=~") string { "," ... } "}" ]

Evaluation over scrapes ``(t_i, samples_i)``: a selector is the instant vector of scrape ``i``;
``rate(m[w])`` is the per-second increase between scrapes ``i - 1`` and ``i`` (the range ``w`` is
not applied: the scrapes are the samples; a counter reset counts from zero); ``sum by`` groups;
``histogram_quantile`` interpolates linearly inside the bucket as Prometheus does; ``a / b``
matches series with equal labels (a lone series on each side always matches). Grafana template
variables (``$name``) are replaced from ``variables`` before parsing.

Used by ``tools/render_dashboard.py`` (the README's dashboard PNG) and by the tests that check
every dashboard query names a metric of a real scrape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]
"""A series' labels, sorted."""
Samples = Mapping[tuple[str, Labels], float]
"""One scrape: (sample name, labels) -> value."""
Vector = dict[Labels, float]


class UnsupportedQuery(ValueError):
    """A query outside the subset (or not PromQL at all)."""


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...] = ()
    """(label, ``=`` or ``=~``, value)."""


@dataclass(frozen=True)
class Rate:
    selector: Selector
    window: str


@dataclass(frozen=True)
class Sum:
    by: tuple[str, ...] | None
    inner: Selector | Rate


@dataclass(frozen=True)
class Quantile:
    q: float
    inner: Sum | Selector | Rate


@dataclass(frozen=True)
class Div:
    left: Node
    right: Node


Node = Selector | Rate | Sum | Quantile | Div

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<dur>\[\d+[smhd]\])|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<op>=~|[(){},/=]))"
)


def parse_samples(text: str) -> dict[tuple[str, Labels], float]:
    """A Prometheus text exposition -> samples (comments and blank lines skipped)."""
    out: dict[tuple[str, Labels], float] = {}
    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if m is None:
            continue
        labels = tuple(sorted(label_re.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


class PromQLSubset:
    """Parser and evaluator of one query (see the module docstring)."""

    def __init__(self, query: str, variables: Mapping[str, str] | None = None) -> None:
        self.query = query
        text = query
        for name, value in (variables or {}).items():
            text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
        if "$" in text:
            raise UnsupportedQuery(f"{query!r}: unresolved template variable")
        self._tokens = self._lex(text)
        self._pos = 0
        self.node = self._expr()
        if self._pos != len(self._tokens):
            raise UnsupportedQuery(f"{query!r}: unexpected {self._tokens[self._pos][1]!r}")

    # ---- parsing ------------------------------------------------------------------------
    def _lex(self, text: str) -> list[tuple[str, str]]:
        tokens, pos = [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise UnsupportedQuery(f"{self.query!r}: cannot read {text[pos:pos + 12]!r}")
            kind = m.lastgroup or ""
            tokens.append((kind, m.group(kind)))
            pos = m.end()
        return tokens

    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else None

    def _take(self, kind: str, value: str | None = None) -> str:
        tok = self._peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            found = "the end" if tok is None else repr(tok[1])
            raise UnsupportedQuery(f"{self.query!r}: expected {value or kind}, found {found}")
        self._pos += 1
        return tok[1]

    def _expr(self) -> Node:
        left = self._term()
        if self._peek() == ("op", "/"):
            self._pos += 1
            return Div(left, self._term())
        return left

    def _term(self) -> Node:
        tok = self._peek()
        if tok == ("ident", "sum"):
            self._pos += 1
            by = None
            if self._peek() == ("ident", "by"):
                self._pos += 1
                self._take("op", "(")
                labels = [self._take("ident")]
                while self._peek() == ("op", ","):
                    self._pos += 1
                    labels.append(self._take("ident"))
                self._take("op", ")")
                by = tuple(labels)
            self._take("op", "(")
            inner = self._inner()
            self._take("op", ")")
            return Sum(by, inner)
        if tok == ("ident", "histogram_quantile"):
            self._pos += 1
            self._take("op", "(")
            q = float(self._take("num"))
            self._take("op", ",")
            term = self._term()
            self._take("op", ")")
            if not isinstance(term, Sum | Selector | Rate) or not 0.0 <= q <= 1.0:
                raise UnsupportedQuery(f"{self.query!r}: histogram_quantile(q in [0, 1], sum/rate of buckets)")
            return Quantile(q, term)
        return self._inner()

    def _inner(self) -> Selector | Rate:
        if self._peek() == ("ident", "rate"):
            self._pos += 1
            self._take("op", "(")
            selector = self._selector()
            window = self._take("dur")
            self._take("op", ")")
            return Rate(selector, window)
        return self._selector()

    def _selector(self) -> Selector:
        name = self._take("ident")
        if name in {"sum", "rate", "histogram_quantile", "by", "avg", "max", "min", "irate", "increase"}:
            raise UnsupportedQuery(f"{self.query!r}: {name} is not supported here")
        matchers: list[tuple[str, str, str]] = []
        if self._peek() == ("op", "{"):
            self._pos += 1
            while self._peek() != ("op", "}"):
                label = self._take("ident")
                tok = self._peek()
                if tok not in (("op", "="), ("op", "=~")):
                    raise UnsupportedQuery(f"{self.query!r}: label matcher must be = or =~")
                self._pos += 1
                value = self._take("str")[1:-1].replace('\\"', '"')
                matchers.append((label, tok[1], value))
                if self._peek() == ("op", ","):
                    self._pos += 1
            self._take("op", "}")
        return Selector(name, tuple(matchers))

    # ---- queries about the expression ---------------------------------------------------
    def metrics(self) -> set[str]:
        """Every sample name the query reads."""
        found: set[str] = set()

        def walk(node: Node) -> None:
            if isinstance(node, Selector):
                found.add(node.metric)
            elif isinstance(node, Rate):
                walk(node.selector)
            elif isinstance(node, Sum | Quantile):
                walk(node.inner)
            else:
                walk(node.left)
                walk(node.right)

        walk(self.node)
        return found

    # ---- evaluation ---------------------------------------------------------------------
    def evaluate(self, scrapes: Sequence[tuple[float, Samples]], i: int) -> Vector:
        """The query's value at scrape ``i`` (``rate`` needs ``i >= 1``)."""
        return self._eval(self.node, scrapes, i)

    def series(self, scrapes: Sequence[tuple[float, Samples]]) -> dict[Labels, list[tuple[float, float]]]:
        """Every series over the scrapes: labels -> [(t, value)] (scrape 0 skipped for rates)."""
        start = 1 if self._has_rate(self.node) else 0
        out: dict[Labels, list[tuple[float, float]]] = {}
        for i in range(start, len(scrapes)):
            for labels, v in self.evaluate(scrapes, i).items():
                out.setdefault(labels, []).append((scrapes[i][0], v))
        return out

    def _has_rate(self, node: Node) -> bool:
        if isinstance(node, Rate):
            return True
        if isinstance(node, Sum | Quantile):
            return self._has_rate(node.inner)
        if isinstance(node, Div):
            return self._has_rate(node.left) or self._has_rate(node.right)
        return False

    def _eval(self, node: Node, scrapes: Sequence[tuple[float, Samples]], i: int) -> Vector:
        if isinstance(node, Selector):
            return self._select(node, scrapes[i][1])
        if isinstance(node, Rate):
            if i < 1:
                raise ValueError("rate needs two scrapes")
            (t0, s0), (t1, s1) = scrapes[i - 1], scrapes[i]
            before, now = self._select(node.selector, s0), self._select(node.selector, s1)
            dt = t1 - t0
            if dt <= 0:
                raise ValueError(f"scrapes {i - 1} and {i} are not in time order")
            return {k: ((v - before[k]) if v >= before[k] else v) / dt for k, v in now.items() if k in before}
        if isinstance(node, Sum):
            vec = self._eval(node.inner, scrapes, i)
            out: Vector = {}
            for labels, v in vec.items():
                key = () if node.by is None else tuple(sorted((k, x) for k, x in labels if k in node.by))
                out[key] = out.get(key, 0.0) + v
            return out
        if isinstance(node, Quantile):
            return self._quantile(node.q, self._eval(node.inner, scrapes, i))
        left, right = self._eval(node.left, scrapes, i), self._eval(node.right, scrapes, i)
        if len(left) == 1 and len(right) == 1:
            (lk, lv), (_, rv) = next(iter(left.items())), next(iter(right.items()))
            return {lk: lv / rv if rv else math.nan}
        return {k: (v / right[k] if right[k] else math.nan) for k, v in left.items() if k in right}

    @staticmethod
    def _select(sel: Selector, samples: Samples) -> Vector:
        out: Vector = {}
        for (name, labels), v in samples.items():
            if name != sel.metric:
                continue
            have = dict(labels)
            if all(
                (have.get(k, "") == x) if op == "=" else re.fullmatch(x, have.get(k, "")) is not None
                for k, op, x in sel.matchers
            ):
                out[labels] = v
        return out

    @staticmethod
    def _quantile(q: float, vec: Vector) -> Vector:
        groups: dict[Labels, list[tuple[float, float]]] = {}
        for labels, v in vec.items():
            le = dict(labels).get("le")
            if le is None:
                continue
            key = tuple((k, x) for k, x in labels if k != "le")
            groups.setdefault(key, []).append((math.inf if le == "+Inf" else float(le), v))
        out: Vector = {}
        for key, buckets in groups.items():
            buckets.sort()
            total = buckets[-1][1] if buckets and math.isinf(buckets[-1][0]) else math.nan
            if not total or math.isnan(total):
                out[key] = math.nan
                continue
            rank = q * total
            lower_le, lower_count = 0.0, 0.0
            for le, count in buckets:
                if count >= rank:
                    if math.isinf(le):
                        out[key] = lower_le  # Prometheus: the highest finite bound
                    elif count == lower_count:
                        out[key] = le
                    else:
                        out[key] = lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
                    break
                lower_le, lower_count = le, count
        return out
