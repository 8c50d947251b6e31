"""A checkpoint's names: its directory says its step, its index names its shards; a name that does not
hold what it says is one line naming it, in every command that reads the checkpoint."""
import shutil

import pytest

from data_tools.checkpoint import Checkpoint
from data_tools.errors import CheckpointError
from test_checkpoint import model_state, save, wse


def test_info_on_a_checkpoint_missing_a_shard_names_the_shard_file(tmp_path):
    """`wse checkpoint info` said `unsupported format string passed to NoneType.__format__`."""
    _, params, state = model_state()
    path = save(tmp_path, 4, params, state)
    shard = sorted(path.glob("memoryx_*.h5"))[1]
    shard.unlink()
    for action in ("info", "verify"):
        proc = wse("checkpoint", action, str(path))
        assert proc.returncode == 1 and proc.stderr.splitlines() == [f"wse checkpoint: error: {shard}: missing"], \
            proc.stderr


def test_a_checkpoint_copied_under_another_steps_name_is_refused(tmp_path):
    """checkpoint_2 copied to checkpoint_5 verified clean, and would resume as step 5 from step 2's
    weights: every reader compares the name's step with the index's."""
    _, params, state = model_state()
    save(tmp_path, 2, params, state)
    shutil.copytree(tmp_path / "checkpoint_2", tmp_path / "checkpoint_5")
    said = f"{tmp_path / 'checkpoint_5'}: its index records step 2, not 5: a copy of another step's checkpoint " \
           "under this name?"
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path / "checkpoint_5").load()
    assert str(err.value) == said
    proc = wse("checkpoint", "verify", str(tmp_path / "checkpoint_5"))
    assert proc.returncode == 1 and proc.stderr.splitlines() == [f"wse checkpoint: error: {said}"], proc.stderr
    assert Checkpoint(tmp_path / "checkpoint_2").step == 2  # the original reads as it did
    shutil.copytree(tmp_path / "checkpoint_2", tmp_path / "mine")  # a name of the user's says no step
    Checkpoint(tmp_path / "mine").verify()
