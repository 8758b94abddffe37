"""Evaluating meshlm models with lm-evaluation-harness (an optional dependency: `pip install -e '.[eval]'` in meshlm's folder).

meshlm/eval/lm.py is meshlm's lm-eval model (registered as `meshlm`; importing it needs lm-eval),
meshlm/eval/requests.py the token-level work it does (no lm-eval needed), meshlm/eval/harness.py the
task lookup, the run, lm-eval's JSON and the summary table that `meshlm eval` (meshlm/cli/eval.py) uses.
"""
