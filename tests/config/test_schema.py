import pytest

from jaxpar import JaxparError, load_config


def test_tiny_config_and_overrides():
    cfg = load_config("configs/tiny.yaml", ["train.lr=1e-3", "model.tie_embeddings=true",
                                             "mesh.tensor=4"])
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is True
    # Overriding a mesh axis replaces the file's mesh: the other axes take the defaults.
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (-1, 1, 4)
    kept = load_config("configs/tiny.yaml", ["mesh.tensor=4", "mesh.fsdp=-1"], keep_mesh=True)
    assert (kept.mesh.data, kept.mesh.fsdp, kept.mesh.tensor) == (1, -1, 4)
    assert cfg.model.head_dim == cfg.model.d_model // cfg.model.n_heads


def test_unknown_key_suggests_closest():
    with pytest.raises(JaxparError, match=r"unknown config key 'train.stpes'; did you mean "
                                          r"'train.steps'\?"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(JaxparError, match=r"'model.d_modle'.*'model.d_model'"):
        load_config(None, ["model.d_modle=3"])


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mesh:\n  tensr: 2\n")
    with pytest.raises(JaxparError, match=r"'mesh.tensr'; did you mean 'mesh.tensor'"):
        load_config(path)


def test_wrong_type_and_missing_file(tmp_path):
    with pytest.raises(JaxparError, match=r"'train.steps' expects int, got 'many'"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(JaxparError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_model_validation():
    with pytest.raises(JaxparError, match="multiple of model.n_kv_heads"):
        load_config(None, ["model.n_heads=4", "model.n_kv_heads=3"])


def test_save_round_trip(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["train.steps=7"])
    cfg.save(tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_a_yaml_boolean_word_in_a_text_key_stays_the_word():
    """YAML 1.1 reads ``off`` as false: train.compile_cache=off turned the cache off, not
    into a folder named False."""
    import jaxpar

    assert jaxpar.load_config(None, ["train.compile_cache=off"]).train.compile_cache == "off"
