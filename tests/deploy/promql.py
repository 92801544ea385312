"""What a PromQL expression reads: its series selectors and the labels it groups by, from the parse tree."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import promql_parser

# Grafana's variables, replaced by values of the same type so that a dashboard query parses as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


@dataclass(frozen=True)
class Selector:
    """`name{label op "value", ...}` as written in an expression."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)

    def equal_values(self, label: str) -> list[str]:
        return [value for name, op, value in self.matchers if name == label and op == "="]


@dataclass
class Grouping:
    """`sum by (labels) (expr)`: the labels, the selectors under it, and labels label_replace makes there."""

    labels: tuple[str, ...]
    selectors: list[Selector] = field(default_factory=list)
    made_labels: set[str] = field(default_factory=set)


@dataclass
class Reads:
    selectors: list[Selector] = field(default_factory=list)
    groupings: list[Grouping] = field(default_factory=list)


def from_grafana(expr: str, **variables: str) -> str:
    """A dashboard query with its $variables replaced (rate intervals by durations, others by `variables`)."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return _VARIABLE.sub(lambda m: variables.get(m.group(1), m.group(0)), expr)


def reads(expr: str) -> Reads:
    """Parse `expr` (raising ValueError when it is not valid PromQL) and list what it reads."""
    tree = promql_parser.parse(expr)
    found = Reads()
    found.selectors = _selectors(tree)

    def visit(node: object) -> bool:
        grouped = isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None
        if grouped and node.modifier.type == promql_parser.AggModifierType.By:
            found.groupings.append(
                Grouping(tuple(node.modifier.labels), _selectors(node.expr), _made_labels(node.expr))
            )
        return True

    promql_parser.walk(tree, visit)
    return found


def _selectors(tree: object) -> list[Selector]:
    selectors: list[Selector] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple(
                (m.name, _OPERATORS[str(m.op)], m.value) for m in node.matchers.matchers if m.name != "__name__"
            )
            selectors.append(Selector(node.name or "", matchers))
        return True

    promql_parser.walk(tree, visit)
    return selectors


def _made_labels(tree: object) -> set[str]:
    made: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.Call) and node.func.name in ("label_replace", "label_join"):
            made.add(node.args[1].val)
        return True

    promql_parser.walk(tree, visit)
    return made


_OPERATORS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}
