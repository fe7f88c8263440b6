"""Stop strings matched in time proportional to the new text, whatever the list (Aho-Corasick).

`StopStrings` is the automaton over one request's stop list: a trie of the strings with failure
links, built once per request and shared by its choices. A choice keeps only its state (a node);
each new character moves it one edge (amortised), so a step costs O(new characters) whether the
list holds one string or thousands. The node's depth is also the longest tail of the text that
could still grow into a stop string: what a detokenizer must hold back.
"""

from __future__ import annotations

from collections import deque

ROOT = 0


class StopStrings:
    def __init__(self, stops: str | list[str] | tuple[str, ...]):
        if isinstance(stops, str):
            stops = [stops]
        self.strings = tuple(dict.fromkeys(s for s in stops if s))  # order kept, no duplicates
        self._edges: list[dict[str, int]] = [{}]  # node -> character -> child
        self._depth = [0]  # node -> length of the prefix it spells
        self._match = [0]  # node -> length of the longest stop string ending here (0: none)
        for string in self.strings:
            self._insert(string)
        self._fail = self._failure_links()

    def _insert(self, string: str) -> None:
        node = ROOT
        for char in string:
            child = self._edges[node].get(char)
            if child is None:
                child = len(self._edges)
                self._edges[node][char] = child
                self._edges.append({})
                self._depth.append(self._depth[node] + 1)
                self._match.append(0)
            node = child
        self._match[node] = len(string)

    def _failure_links(self) -> list[int]:
        """node -> the node of its longest proper suffix that is in the trie (breadth first)."""
        fail = [ROOT] * len(self._edges)
        queue = deque([ROOT])
        while queue:
            node = queue.popleft()
            for char, child in self._edges[node].items():
                link = fail[node]
                while link != ROOT and char not in self._edges[link]:
                    link = fail[link]
                fail[child] = self._edges[link].get(char, ROOT) if node != ROOT else ROOT
                # A node ends the stop string it spells, or else the longest one its suffix ends.
                if not self._match[child]:
                    self._match[child] = self._match[fail[child]]
                queue.append(child)
        return fail

    def __bool__(self) -> bool:
        return bool(self.strings)

    def advance(self, node: int, char: str) -> int:
        """The state after reading `char` in state `node`."""
        edges = self._edges
        while node != ROOT and char not in edges[node]:
            node = self._fail[node]
        return edges[node].get(char, ROOT)

    def match_length(self, node: int) -> int:
        """Length of the longest stop string that ends at this state, 0 if none does."""
        return self._match[node]

    def pending_length(self, node: int) -> int:
        """Length of the longest tail of the text read that is a prefix of some stop string."""
        return self._depth[node]
