"""The counting rule and its vocabulary: which holder of each replicated element counts it (its one
text is ``docs/counting.md``), and the words the registry records. Ground: the adapter and
everything above it read them.

- :mod:`.vocabulary` — ``Source``, ``NotCounted``: the registry's vocabularies.
- :mod:`.ownership` — the counting rule: which holder of each replicated element counts it.
"""
