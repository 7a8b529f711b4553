"""Empirical privacy audits of released models: does the privacy hold?

* ``bounds``: statistical lower bounds on ε from audit outcomes (canary guesses, Steinke et al.'s
  one-run bound and its ceilings, Clopper-Pearson), pure numpy/scipy;
* ``attacks``: membership-inference attacks and their metrics, pure functions over logits;
* ``plan``: an audit's plan (the disjoint pool, population, canaries; R runs) and its directory;
* ``membership``: ``fedpower-audit``, which trains the audit runs and stores their logits;
* ``report``: the report of an audit's runs (every attack leave-one-out, the canary bound, the
  ROC with the DP ceiling) and ``compare`` across audits.
"""
