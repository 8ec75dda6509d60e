from __future__ import annotations
import typing


class Node:
    pass


def find(name: str) -> Node | None:
    return None


def children(n: Node) -> "list[Node]":
    return []


def lookup(key: str) -> typing.Union[str, int, None]:
    return None
