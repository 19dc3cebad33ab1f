"""The resume proof: a fingerprint of every (param, state), bitwise and independent of the layout,
in one all-reduce, and the comparison of two of them.

- :mod:`.fingerprint` — the resume proof: ``StateFingerprint`` of every (param, state), one
  all-reduce.
- :mod:`.report` — the resume proof's comparison: ``verify_resume``, ``ResumeReport``, the causes in
  words.
"""
