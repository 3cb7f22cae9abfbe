"""The data contracts the README states: a random-access dataset's `__getitems__(ids)` returns a list of row dicts
or a dict of arrays stacked along a leading axis of len(ids), anything else is refused in one line; and a dataset
named by import path (`data.name = "module:fn"`) is `fn(data section) -> (train, eval)` dicts of arrays."""

import sys
import textwrap

import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.cli import config as config_lib
from jdp.cli.build import build_task
from jdp.cli.train import run
from jdp.data import DataError
from tests.test_fit import Regressor, Rows, mse, regression_data


class StackedRows(Rows):
    """`__getitems__` returns one dict of arrays stacked along the rows."""

    def __getitems__(self, ids):
        return {k: v[ids] for k, v in self.arrays.items()}


class ListedRows(Rows):
    """`__getitems__` returns a list of row dicts."""

    def __getitems__(self, ids):
        return [self[i] for i in ids]


class Returns(Rows):
    """`__getitems__` returns whatever `make(arrays, ids)` makes."""

    def __init__(self, arrays, make):
        super().__init__(arrays)
        self.make = make

    def __getitems__(self, ids):
        return self.make(self.arrays, ids)


def _fit(data, **options):
    options = {"steps": 3, "global_batch_size": 32, "optimizer": optax.sgd(0.1), "log_every": 1, "num_devices": 2,
               **options}
    return jdp.fit(lambda: Regressor(nnx.Rngs(0)), mse, data, **options)


@pytest.mark.parametrize("dataset", [StackedRows, ListedRows], ids=["dict_of_stacked_arrays", "list_of_rows"])
def test_getitems_returning_either_form_trains_like_the_same_arrays(dataset):
    """Either form of `__getitems__` must give the very batches the arrays give: else the losses differ (or the
    dict form crashes with `string indices must be integers`, as it did)."""
    arrays = _fit(regression_data(), eval_data=regression_data(64, seed=1))
    rows = _fit(dataset(regression_data()), eval_data=dataset(regression_data(64, seed=1)))
    assert rows.losses == arrays.losses
    assert rows.eval_metrics == arrays.eval_metrics


@pytest.mark.parametrize("make, returned", [
    (lambda a, ids: {k: v[ids][:-1] for k, v in a.items()}, r"a dict of 'x': \(31, 6\), 'y': \(31,\) for 32 ids"),
    (lambda a, ids: {"x": a["x"][ids]}, r"a dict of 'x': \(32, 6\) for 32 ids"),
    (lambda a, ids: {k: v[ids][0] for k, v in a.items()}, r"a dict of 'x': \(6,\), 'y': \(\) for 32 ids"),
    (lambda a, ids: "rows", "a str for 32 ids"),
    (lambda a, ids: a["x"][ids], "a ndarray for 32 ids"),
    (lambda a, ids: [{"x": a["x"][i]} for i in ids], r"a list of 32 whose item 0 is a dict with keys \['x'\]"),
    (lambda a, ids: [{k: v[i] for k, v in a.items()} for i in ids[:-1]], "a list of 31 rows for 32 ids"),
    (lambda a, ids: [tuple(a["x"][i]) for i in ids], "a list of 32 whose item 0 is a tuple"),
])
def test_any_other_getitems_return_is_refused_in_one_line(make, returned):
    """A wrong `__getitems__` must be named in one line with what it returned and what jdp expects: else the run
    dies in a raw TypeError or KeyError deep in the batcher, or trains on mis-sized batches."""
    with pytest.raises(DataError, match=returned) as error:
        _fit(Returns(regression_data(), make))
    message = str(error.value)
    assert isinstance(error.value, jdp.UsageError) and "\n" not in message
    assert message.startswith("the train data's __getitems__ returned ")
    assert message.endswith("return a list of 32 row dicts with keys ['x', 'y'], or a dict of those keys to arrays "
                            "of leading length 32")


def test_a_row_without_a_key_is_refused_in_one_line_without_getitems():
    """`__getitem__` alone: a later row missing a key of row 0 must be named in one line, not a raw KeyError."""

    class Ragged(Rows):
        def __getitem__(self, i):
            row = super().__getitem__(i)
            return row if i == 0 else {"x": row["x"]}

    with pytest.raises(DataError, match=r"__getitem__ over 32 ids gave a list of 32 whose item \d+ is a dict with "
                                        r"keys \['x'\]; every row must be a dict with keys \['x', 'y'\]$"):
        _fit(Ragged(regression_data()))


BLOBS = '''
import numpy as np


def make(data):
    n, m = data.num_examples, data.num_eval_examples
    x = np.random.default_rng(0).normal(size=(n + m, *data.shape)).astype(np.float32)
    y = (x.reshape(n + m, -1).sum(1) > 0).astype(np.int32)
    return {"x": x[:n], "y": y[:n]}, {"x": x[n:], "y": y[n:]}
'''  # the README's example, as printed

CONFIG = '''
from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "mlp"
    c.model.kwargs.hidden_sizes = (16,)
    c.data.update(name="jdp_test_blobs:make", shape=(5,), num_examples=96, num_eval_examples=32)
    c.train.update(steps=3, global_batch_size=32, log_every=1, eval_every=3)
    c.optim.update(name="sgd", lr=0.1, schedule="constant")
    c.parallel.num_devices = 2
    c.compile_cache_dir = ""
    return c
'''


def test_a_dataset_by_import_path_is_called_with_the_data_section(tmp_path, monkeypatch):
    """`data.name = "module:fn"` beside the config: fn(cfg.data) -> (train, eval) dicts of arrays, trained from.
    If jdp passed anything else, or wanted another return, the sizes and shapes below would not match."""
    (tmp_path / "jdp_test_blobs.py").write_text(textwrap.dedent(BLOBS))
    (tmp_path / "my_config.py").write_text(textwrap.dedent(CONFIG))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the config's folder is made importable: undo it after
    try:
        cfg = config_lib.load_config_file(tmp_path / "my_config.py")
        task = build_task(cfg)
        assert (task.source.num_train, task.source.num_eval) == (96, 32)
        assert task.source.input_shape == (5,) and task.source.num_classes == 2
        task.source.close()
        result = run(cfg, tmp_path / "run")
    finally:
        sys.modules.pop("jdp_test_blobs", None)
    assert result.step == 3 and len(result.losses) == 3 and np.isfinite(result.losses).all()
    assert 0 <= result.eval_metrics["accuracy"] <= 1


class PaddedPerBatch(Rows):
    """A collate that pads each batch's 'm' to its longest row: 8 at the first batch, 7 after."""

    def __getitems__(self, ids):
        self.calls = getattr(self, "calls", 0) + 1
        return {**{k: v[ids] for k, v in self.arrays.items()}, "m": np.zeros((len(ids), 8 if self.calls < 3 else 7))}


def test_rows_of_a_shape_that_changes_between_batches_or_within_one_are_one_line():
    """A batch whose rows have another shape than the first batch's ran the executable compiled for those: a
    TypeError traceback that blamed enable_x64; rows of two shapes in one batch were np.stack's ValueError, naming
    neither the key nor the row."""
    with pytest.raises(DataError, match=r"^the train data's rows of 'm' have shape \(7,\) in this batch, \(8,\) in "
                                        r"its first; the compiled step takes one shape: pad every row to one length$"):
        _fit(PaddedPerBatch({**regression_data(), "m": np.zeros((256, 8))}))

    class Ragged(Rows):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "m": np.zeros(3 if i == 37 else 2)}

    with pytest.raises(DataError, match=r"^the train data's row 37 has 'm' of shape \(3,\), row \d+ \(2,\); a batch "
                                        r"stacks rows of one shape: pad them to one length$"):
        _fit(Ragged(regression_data()), steps=16)


def test_eval_rows_the_model_cannot_take_are_refused_before_training(tmp_path):
    """The eval_fn was checked on the train batch's shapes: eval rows of 5 features for a model of 6 trained every
    step and saved its checkpoint, then failed at the eval with a traceback (and again at every rerun)."""
    narrow = {"x": np.zeros((16, 5), np.float32), "y": np.zeros(16, np.float32)}
    with pytest.raises(jdp.FitError, match=r"^eval_fn\(model, batch\) failed on an eval batch of rows \{'x': \(5,\), "
                                           r"'y': \(\)\}: TypeError: dot_general"):
        _fit(regression_data(), eval_data=narrow, workdir=tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
