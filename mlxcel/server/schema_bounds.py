"""Bounds on a JSON schema before llguidance sees it: its size, its depth with every ``$ref`` followed, the
cost of its patterns and literals (each, and all of them together), and an object's properties when none is
required.

llguidance compiles a schema by recursion on the calling thread's native
stack, following each ``$ref`` into its target as it goes. Its JSON parser
refuses text nested deeper than 128 levels, but a chain of references is
flat text: ``{"$defs": {"d0": {... {"$ref": "#/$defs/d1"}}, "d1": ...}}``
nests two or three levels per link on the page and one more link of native
recursion per reference. About 925 such links overflow an 8 MiB thread stack
and the process dies with SIGSEGV: no exception, no log line, every stream cut.
Measured on llguidance 1.9 (``docs/http-api.md``): 2.5-3.4 KiB of stack per
level, whatever the keyword (``properties``, ``items``, ``anyOf``, ``allOf``,
bare aliases).

So a schema is measured here first, as the compiler would walk it: a
reference counts as its target written in its place, and a reference back to
a target already being expanded is recursion (the compiler makes it a rule
that refers to itself, with no deeper stack), so it adds nothing. The depth
may not exceed :data:`MAX_SCHEMA_DEPTH`, about 430 KiB of stack at the worst
measured cost: 5% of a default 8 MiB thread stack, under half of 1 MiB.

Only local references (``#`` and ``#/json/pointer``) are followed, and only
the root may carry an ``$id``; anything else (a remote reference, an anchor,
a nested ``$id``, which moves the base that ``#/...`` resolves against) is
refused: a reference this walk cannot resolve as llguidance would is one
whose depth it cannot bound. Values (``const``, ``enum``, ``default``,
``examples``) count for their nesting but are data, not schemas: nothing in
them is followed. Pure Python; no I/O, no llguidance.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

MAX_SCHEMA_DEPTH = 128
"""Levels of arrays and objects, every ``$ref`` followed. A schema written out has at most 64 (the body's own
bound); 128 leaves room for about 25 levels of nested models referenced through ``$defs``."""
MAX_SCHEMA_BYTES = 256 * 1024
"""The schema's JSON text. OpenAI's own limits (5,000 properties, 120,000 characters of names and values) fit."""


class SchemaTooLarge(ValueError):
    """A schema outside the bounds; the message says which and by how much (one line)."""


def check_schema(schema: Any, text: str) -> None:
    """Raise :class:`SchemaTooLarge` if *schema* (whose JSON is *text*) is too large or too deep to compile safely."""
    if len(text) > MAX_SCHEMA_BYTES:
        raise SchemaTooLarge(f"the schema is {len(text)} bytes of JSON, more than {MAX_SCHEMA_BYTES}")
    _Walk(schema).height(schema, MAX_SCHEMA_DEPTH)


class _TooDeep(Exception):
    pass


MAX_PATTERN_COST = 1000
"""The most one ``pattern``, ``patternProperties`` key or ``const``/``enum`` string may cost, written out
(:func:`pattern_cost`: ``a{1000}`` and a 1,000-character literal cost 1,000, ``a{500}b{500}`` too). llguidance's
mask for a string lexeme grows with its length unrolled (1,024-token vocabulary, per token: 0.22 ms at
1,000, 3.3 ms at 16,000, 14 ms for a 65,535-character literal or ``const``, 67 ms for ``a{1000}`` written 256
times: ``benchmarks/grammar_mask.py``), and it is computed on the batch's critical path, so one such request
slowed every stream decoding beside it several times."""

MAX_SCHEMA_COST = 50_000
"""The cost of every pattern, ``patternProperties`` key and ``const``/``enum`` string of a schema added (a
``$ref`` target once, as the compiler builds it once): what llguidance's lexer is built from. 300 date
patterns cost about 4,000 and an enum of 2,000 ten-letter words 20,000; 300 properties each ``^a{1000}$``
cost 300,000."""

MAX_OPTIONAL_PROPERTIES = 500
"""Properties of one object when none of them is required. llguidance 1.9 parses such an object with every
property a candidate for the next key: 4 items each in its parser's row, which holds at most 2,000, so 501 or
more fail at the object's first key (measured with ``additionalProperties`` true, false or a schema, at every
value type, nested, in ``anyOf``, in an array), after a compile that grows with their number squared (3.6 s at
6,000): the request would get its 400 only after seconds of a core. With one property required llguidance
builds another grammar that has no such row (600 measured): those are not bounded here.
``tests/server/test_schema_bounds.py`` checks the bound against the installed llguidance."""

DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, never read as schemas."""


class _Walk:
    """The height of a schema with its references followed, stopping as soon as it passes the bound.

    The recursion here is Python's, at most :data:`MAX_SCHEMA_DEPTH` frames deep (the walk gives up there).
    """

    def __init__(self, root: Any) -> None:
        self.root = root
        self.cost = 0
        """What the patterns and literals walked so far cost (:data:`MAX_SCHEMA_COST`)."""
        self.expanding: set[str] = set()
        self.heights: dict[str, int] = {}
        """Each reference target's height, once known: a target is measured once, however often it is used."""

    def height(self, node: Any, budget: int) -> int:
        try:
            return self._height(node, budget)
        except _TooDeep:
            raise SchemaTooLarge(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels of arrays and objects, "
                                 "counting each $ref as its target written in its place") from None

    def _height(self, node: Any, budget: int, data: bool = False) -> int:
        if not isinstance(node, dict | list):
            return 0
        if budget <= 0:
            raise _TooDeep
        if isinstance(node, list):
            return 1 + max((self._height(item, budget - 1, data) for item in node), default=0)
        below = max((self._height(value, budget - 1, data or key in DATA_KEYWORDS) for key, value in node.items()),
                    default=0)
        if data:
            return 1 + below
        if isinstance(node.get("$id"), str) and node is not self.root:
            raise SchemaTooLarge("$id is supported only at the schema's root (a nested $id moves the base "
                                 "its references resolve against)")
        self._count_literals(node)
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES and not node.get("required"):
            raise SchemaTooLarge(f"an object has {len(properties)} properties and none is required; at most "
                                 f"{MAX_OPTIONAL_PROPERTIES} when none is (llguidance's parser cannot hold more "
                                 "candidates for the next key): require one, or split the object")
        reference = node.get("$ref")
        if isinstance(reference, str):
            below = max(below, self._target_height(reference, budget - 1))
        return 1 + below

    def _count_literals(self, node: dict[str, Any]) -> None:
        """Add the cost of *node*'s patterns and literal strings; refuse one, or the total, past its bound."""
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        costs = [(pattern_cost(pattern), "a pattern", pattern) for pattern in patterns]
        literals = [node["const"]] if isinstance(node.get("const"), str) else []
        if isinstance(node.get("enum"), list):
            literals += [value for value in node["enum"] if isinstance(value, str)]
        costs += [(len(literal), "a literal string", literal) for literal in literals]
        for cost, kind, text in costs:
            if cost > MAX_PATTERN_COST:
                raise SchemaTooLarge(f"{kind} costs {cost} written out ({text[:40]!r}); at most {MAX_PATTERN_COST} "
                                     "(a literal counts its length, a count multiplies what it repeats, a sequence "
                                     "adds its parts): a string's length is bounded with maxLength")
            self.cost += cost
        if self.cost > MAX_SCHEMA_COST:
            raise SchemaTooLarge(f"the schema's patterns and literal strings cost {self.cost} written out together, "
                                 f"more than {MAX_SCHEMA_COST}")

    def _target_height(self, reference: str, budget: int) -> int:
        if reference in self.expanding:
            return 0  # recursion: the compiler refers back to the rule it is building
        if reference not in self.heights:
            target = self._resolve(reference)
            self.expanding.add(reference)
            try:
                self.heights[reference] = self._height(target, budget)
            finally:
                self.expanding.discard(reference)
        if self.heights[reference] > budget:
            raise _TooDeep
        return self.heights[reference]

    def _resolve(self, reference: str) -> Any:
        """The target of a local reference: ``#`` (the root) or ``#/a/b`` (a JSON pointer in a URI fragment)."""
        if reference != "#" and not reference.startswith("#/"):
            raise SchemaTooLarge(f"$ref {reference[:80]!r} is not supported: only local references "
                                 "('#' or '#/$defs/name') are")
        node = self.root
        for raw in reference[2:].split("/") if reference != "#" else ():
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaTooLarge(f"$ref {reference[:80]!r} does not resolve within the schema")
        return node


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def pattern_cost(pattern: str) -> int:
    """The length of *pattern* written out, which is what llguidance's lexer unrolls: an atom (a character, an
    escape, a character class) costs 1; a count (``{n}``, ``{n,}``: n; ``{n,m}``: m) multiplies the atom or
    group before it (``*``, ``+`` and ``?`` by 1); a group costs what it holds, its alternatives added; the
    pattern, the sum of its parts. A scan of the syntax, not a regex engine: a ``{`` that is not a count is a
    literal (as in ECMA-262), and an unbalanced pattern is measured as far as it goes."""
    totals = [0]  # the cost of each open group so far
    last = 0  # the cost of the atom or group a count would apply to, already in totals[-1]
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "(":
            totals.append(0)
            i, last = i + 1, 0
            continue
        if char == ")" and len(totals) > 1:
            last = totals.pop()
            totals[-1] += last
            i += 1
            continue
        if char == "{" and (count := _COUNT.match(pattern, i)):
            low, _, high = count.groups()
            factor = int(high) if high else int(low)
            totals[-1] += last * (factor - 1)
            last *= factor
            i = count.end()
            continue
        if char in "|^$":
            i, last = i + 1, 0
            continue
        if char in "*+?":
            i += 1
            continue
        i = i + 2 if char == "\\" else _class_end(pattern, i) if char == "[" else i + 1
        totals[-1] += 1
        last = 1
    return sum(totals)


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` closing the character class opened at *start*."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading ] is a literal
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
