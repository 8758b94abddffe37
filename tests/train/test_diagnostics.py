"""NonFiniteWatch: what it knows when a step goes NaN/Inf besides the step (the run's first step, whether the
weights it started from were finite, the first batch with token ids outside the vocabulary)."""

import jax.numpy as jnp
import numpy as np

from meshlm.train.diagnostics import NonFiniteWatch

FINITE = {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0)}
NAN = {"loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(jnp.nan)}


def batch(top):
    ids = np.array([[1, 2, 3], [4, 5, top]], np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def test_a_nan_after_finite_steps_is_training():
    watch = NonFiniteWatch(vocab_size=16)
    watch.start(3, {"w": jnp.ones(4)})
    for step, metrics in ((3, FINITE), (4, FINITE), (5, NAN), (6, FINITE)):
        watch.observe(step, metrics, batch(15))
    bad = watch.check(6)
    assert (bad.step, bad.first_step, bad.start_weights_finite, bad.bad_ids) == (5, 3, True, None)
    assert bad.cause() == "training"


def test_the_first_batch_with_an_id_outside_the_vocabulary_is_named():
    watch = NonFiniteWatch(vocab_size=16)
    watch.start(1, {"w": jnp.ones(4)})
    watch.observe(1, FINITE, batch(15))
    watch.observe(2, FINITE, batch(16))  # the last target: the one id inputs do not hold
    watch.observe(3, NAN, batch(40))
    bad = watch.check(3)
    assert bad.bad_ids == (2, 16) and bad.vocab_size == 16 and bad.cause() == "data"
    negative = NonFiniteWatch(vocab_size=16)
    negative.observe(1, NAN, {"inputs": np.array([[3, -2]]), "targets": np.array([[-2, 4]])})
    assert negative.check(1).bad_ids == (1, -2)


def test_ids_of_batches_after_the_bad_step_are_not_its_cause():
    watch = NonFiniteWatch(vocab_size=16)
    watch.observe(1, NAN, batch(15))
    watch.observe(2, FINITE, batch(99))
    assert watch.check(2).bad_ids is None


def test_weights_not_finite_at_the_start_and_a_nan_at_the_first_step():
    watch = NonFiniteWatch(vocab_size=16)
    watch.start(1, {"w": jnp.array([1.0, jnp.inf]), "step": jnp.int32(0)})
    watch.observe(1, NAN, batch(15))
    assert watch.check(1).cause() == "weights"
    clean = NonFiniteWatch(vocab_size=16)
    clean.start(1, {"w": jnp.ones(2)})
    clean.observe(1, NAN, batch(15))
    assert clean.check(1).cause() == "first step"


def test_nothing_bad_is_none():
    watch = NonFiniteWatch(vocab_size=16)
    watch.start(1, {"w": jnp.ones(2)})
    watch.observe(1, FINITE, batch(99))  # ids alone stop nothing: the loss decides
    assert watch.check(1, {"w": jnp.ones(2)}) is None
