"""Empirical privacy audits of released models: does the privacy hold?

* ``bounds``: statistical lower bounds on ε from audit outcomes (canary guesses, Steinke et al.'s
  one-run bound and its ceilings, Clopper-Pearson), pure numpy/scipy;
* ``attacks``: membership-inference attacks and their metrics, pure functions over logits;
* ``membership``: ``fedpower-audit``, which trains the audit runs, stores their logits and writes
  the report.
"""
