"""Config system: strict typed loading, key-path errors, overrides, inheritance, round trip, CLI."""

from __future__ import annotations

import os
import textwrap

import pytest
import yaml

import megaroute.cli
from megaroute.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    apply_overrides,
    config_from_dict,
    config_hash,
    flatten,
    load_config,
    load_raw,
    save_config,
    to_yaml,
)


def write(path, text: str) -> str:
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def assert_rejected(exc_info, path: str, *fragments: str) -> None:
    err = exc_info.value
    msg = str(err)
    assert err.path == path, msg
    assert f"'{path}'" in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


# ----------------------------------------------------------------------------- bad input

BAD_OVERRIDES = [
    # unknown keys, with did-you-mean
    ("modle.d_model=64", "modle", ["unknown key", "did you mean 'model'"]),
    ("model.n_layer=4", "model.n_layer", ["unknown key", "did you mean 'n_layers'"]),
    ("routing.capacty=0.5", "routing.capacty", ["did you mean 'capacity'"]),
    ("data.tokenizer.vocab_sz=64", "data.tokenizer.vocab_sz", ["did you mean 'vocab_size'"]),
    ("model.zzzzzz=1", "model.zzzzzz", ["unknown key"]),
    # wrong types
    ("model.d_model=abc", "model.d_model", ["expected int", "str"]),
    ("model.d_model=64.5", "model.d_model", ["expected int", "float"]),
    ("model.n_layers=true", "model.n_layers", ["expected int", "bool"]),
    ("model.tie_embeddings=1", "model.tie_embeddings", ["expected bool", "int"]),
    ("optim.lr=fast", "optim.lr", ["expected float", "str"]),
    ("optim.lr=true", "optim.lr", ["expected float", "bool"]),
    ("optim.betas={a: 1}", "optim.betas", ["expected a list", "dict"]),
    ("optim.betas=[0.9, x]", "optim.betas[1]", ["expected float"]),
    ("tracking.tags=[a, b]", "tracking.tags", ["expected a mapping", "list"]),
    ("tracking.tags.seed=1", "tracking.tags.seed", ["expected str", "int"]),
    ("train.max_tokens=lots", "train.max_tokens", ["expected int or null"]),
    ("model=5", "model", ["must be a section", "int"]),
    ("data.tokenizer=char", "data.tokenizer", ["must be a section", "str"]),
    ("name=[a]", "name", ["expected str", "list"]),
    ("name=1e5", "name", ["expected str", "float"]),  # numbers for str fields must be quoted
    ("variant=123", "variant", ["expected str", "int"]),
    # out of range
    ("routing.capacity=0", "routing.capacity", ["(0, 1]"]),
    ("routing.capacity=1.5", "routing.capacity", ["(0, 1]", "1.5"]),
    ("routing.capacity=-0.25", "routing.capacity", ["(0, 1]"]),
    ("model.n_heads=5", "model.n_heads", ["does not divide d_model=32"]),
    ("model.n_heads=0", "model.n_heads", ["> 0"]),
    ("model.n_heads=32", "model.n_heads", ["even"]),  # head dim 1: RoPE needs pairs
    ("model.d_ff=-1", "model.d_ff", ["> 0"]),
    ("optim.lr=-1e-3", "optim.lr", ["> 0"]),
    ("optim.lr=0", "optim.lr", ["> 0"]),
    ("optim.min_lr=1.0", "optim.min_lr", ["[0, lr="]),
    ("optim.betas=[0.9]", "optim.betas", ["two values"]),
    ("optim.zero_stage=4", "optim.zero_stage", ["0, 1, 2 or 3"]),
    ("optim.offload_params=true", "optim.offload_params", ["zero_stage 3"]),
    ("routing.every=0", "routing.every", [">= 1"]),
    ("routing.offset=2", "routing.offset", ["[0, every=2)"]),
    ("train.global_batch_size=3", "train.global_batch_size", ["multiple of micro_batch_size=2"]),
    ("data.val_fraction=1.0", "data.val_fraction", ["(0, 1)"]),
    ("name=a/b", "name", ["without '/'"]),
    # Literal mismatch
    ("model.dtype=fp16", "model.dtype", ["must be one of", "'float16'"]),
    ("model.dtype=float64", "model.dtype", ["must be one of"]),
    ("routing.method=mixture", "routing.method", ["'none', 'mod'", "'moe'"]),
    ("routing.router_weight=Sigmoid", "routing.router_weight", ["did you mean 'sigmoid'"]),
    ("routing.gate=sigmoid", "routing.gate", ["was renamed to routing.router_weight"]),
    ("optim.schedule=linear", "optim.schedule", ["'cosine'"]),
    # cross-section checks
    ("data.seq_len=128", "data.seq_len", ["exceeds model.max_seq_len=64"]),
    ("data.tokenizer.vocab_size=500", "data.tokenizer.vocab_size", ["exceeds model.vocab_size=97"]),
]


@pytest.mark.parametrize("override,path,fragments", BAD_OVERRIDES, ids=[b[0] for b in BAD_OVERRIDES])
def test_bad_value_rejected_with_key_path(make_config, override, path, fragments):
    with pytest.raises(ConfigError) as e:
        make_config(override)
    assert_rejected(e, path, *fragments)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_no_routed_block_is_rejected(make_config):
    # every=4, offset=3 with 2 layers: nothing would be routed although method=mod.
    with pytest.raises(ConfigError) as e:
        make_config("routing.method=mod", "model.n_layers=2", "routing.every=4", "routing.offset=3")
    assert_rejected(e, "routing.offset", "no block is routed")
    # the same layout is fine for a dense model, and for mod once a block is routed
    make_config("model.n_layers=2", "routing.every=4", "routing.offset=3")
    make_config("routing.method=mod", "model.n_layers=4", "routing.every=4", "routing.offset=3")


def test_unknown_keys_in_yaml_files(tmp_path):
    top = write(tmp_path / "top.yaml", "modell:\n  d_model: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(top)
    assert_rejected(e, "modell", "did you mean 'model'")

    nested = write(tmp_path / "nested.yaml", "model:\n  n_layer: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(nested)
    assert_rejected(e, "model.n_layer", "did you mean 'n_layers'")

    deep = write(tmp_path / "deep.yaml", "data:\n  tokenizer:\n    knd: char\n")
    with pytest.raises(ConfigError) as e:
        load_config(deep)
    assert_rejected(e, "data.tokenizer.knd", "did you mean 'kind'")


def test_section_given_a_list_in_yaml(tmp_path):
    p = write(tmp_path / "c.yaml", "optim:\n  - lr\n  - 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert_rejected(e, "optim", "must be a section", "list")


@pytest.mark.parametrize(
    "override,path,fragment",
    [
        ("model.n_layers", "model.n_layers", "key.path=value"),
        ("just-a-word", "just-a-word", "key.path=value"),
        ("configs/tiny.yaml", "configs/tiny.yaml", "a config file goes after --config"),
        ("model..n_layers=3", "model..n_layers", "empty component"),
        (".x=3", ".x", "empty component"),
        ("=3", "", "empty component"),
    ],
)
def test_bad_override_syntax(override, path, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.path == path
    assert fragment in str(e.value)


def test_override_into_a_scalar(make_config):
    with pytest.raises(ConfigError) as e:
        make_config("model.d_model.size=3")
    assert_rejected(e, "model.d_model", "not a section")
    with pytest.raises(ConfigError) as e:
        make_config("optim.betas=[0.9, 0.95]", "optim.betas.0=0.8")  # a list is a value too
    assert_rejected(e, "optim.betas", "not a section")
    with pytest.raises(ConfigError) as e:
        make_config("optim.betas.0=0.8")  # not in the YAML: the override builds a mapping, the schema wants a list
    assert_rejected(e, "optim.betas", "expected a list", "dict")
    # a key absent from the YAML but scalar in the schema: caught by the type check
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.rope_theta.x=1"])
    assert_rejected(e, "model.rope_theta", "expected float", "dict")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert "not found" in str(e.value) and missing in str(e.value)


def test_missing_parent_file_names_base_key(tmp_path):
    child = write(tmp_path / "child.yaml", "base: parent.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert_rejected(e, "base", "not found", "parent.yaml", child)


@pytest.mark.parametrize("bad_base", ["5", "[a.yaml, b.yaml]", "{path: a.yaml}"])
def test_base_must_be_one_path(tmp_path, bad_base):
    p = write(tmp_path / "c.yaml", f"base: {bad_base}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert_rejected(e, "base", "one parent")


def test_inheritance_cycle(tmp_path):
    a = write(tmp_path / "a.yaml", "base: b.yaml\nname: a\n")
    write(tmp_path / "b.yaml", "base: sub/c.yaml\n")
    write(tmp_path / "sub" / "c.yaml", "base: ../a.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert_rejected(e, "base", "inheritance cycle", "a.yaml", "b.yaml", "c.yaml")

    selfref = write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(selfref)
    assert_rejected(e, "base", "inheritance cycle")


def test_chain_without_cycle(tmp_path):
    write(tmp_path / "root.yaml", "model:\n  d_model: 64\n  n_heads: 4\n")
    write(tmp_path / "mid.yaml", "base: root.yaml\n")
    leaf = write(tmp_path / "leaf.yaml", "base: mid.yaml\n")
    assert load_config(leaf).model.d_model == 64


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("- a\n- b\n", "mapping"),
        ("just a string\n", "mapping"),
        ("42\n", "mapping"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)
def test_non_mapping_or_invalid_yaml(tmp_path, text, fragment):
    p = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert fragment in str(e.value)
    assert p in str(e.value)


@pytest.mark.parametrize(
    "text,key,line",
    [
        ("model:\n  d_model: 64\n  d_model: 128\n", "d_model", 3),
        # a second section block would silently replace the first one
        ("model:\n  d_model: 64\n  n_heads: 4\noptim:\n  lr: 1e-3\nmodel:\n  n_layers: 2\n", "model", 6),
    ],
)
def test_duplicate_keys_rejected(tmp_path, text, key, line):
    p = write(tmp_path / "dup.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert f"duplicate key '{key}'" in str(e.value) and f"line {line}" in str(e.value)


def test_yaml_merge_keys_still_work(tmp_path):
    p = write(tmp_path / "merge.yaml", "model:\n  <<: {d_model: 64, n_heads: 8}\n  n_heads: 4\n")
    cfg = load_config(p)
    assert (cfg.model.d_model, cfg.model.n_heads) == (64, 4)


@pytest.mark.parametrize("text", ["", "\n\n", "# model:\n#   d_model: 64\n", "---\n"],
                         ids=["empty", "blank-lines", "comments-only", "empty-document"])
def test_empty_config_file_rejected_naming_the_file(tmp_path, text):
    p = write(tmp_path / "empty.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p, ["model.n_layers=2"])  # overrides do not make an empty file acceptable
    assert p in str(e.value) and "is empty" in str(e.value)
    # ... also as the parent of a non-empty file, which is then the one named
    child = write(tmp_path / "child.yaml", "base: empty.yaml\nname: c\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert p in str(e.value) and "is empty" in str(e.value)


def test_binary_file_or_directory_as_config_rejected_naming_it(tmp_path):
    binary = tmp_path / "model_states.pt"
    binary.write_bytes(b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.")  # a pickle header: not UTF-8
    with pytest.raises(ConfigError, match="not a YAML config") as e:
        load_config(str(binary))
    assert str(binary) in str(e.value)
    with pytest.raises(ConfigError, match="is a directory, not a config file") as e:
        load_config(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_unreadable_hf_tokenizer_is_left_to_prepare(tmp_path):
    # The vocabulary check reads the tokenizer file when there is one; an unreadable one is prepare's
    # error to report (naming data.tokenizer.path), not a TypeError while building this message.
    bogus = write(tmp_path / "tokenizer.txt", "not a tokenizer\n")
    cfg = load_config(None, ["data.tokenizer.kind=hf", f"data.tokenizer.path={bogus}"])
    assert cfg.data.tokenizer.path == bogus


def test_explicit_empty_mapping_gives_defaults(tmp_path):
    p = write(tmp_path / "defaults.yaml", "{}  # all defaults\n")
    assert load_config(p) == Config().validate()
    assert load_config(None) == Config()


# ----------------------------------------------------------------------------- overrides


def test_override_values_are_typed(make_config):
    cfg = make_config(
        "model.n_layers=3",
        "optim.lr=3e-4",  # YAML 1.1 would read this as a string
        "optim.min_lr=1.5e-5",
        "optim.weight_decay=0",  # int accepted for float, stored as float
        "routing.capacity=1",
        "model.tie_embeddings=false",
        "parallel.activation_checkpointing=true",
        "optim.betas=[0.8, 0.99]",
        "model.d_ff=null",
        "model.d_ff=96",  # last one wins
        "train.max_tokens=1e9",  # whole float accepted for int, stored as int
        "train.max_flops=2e18",
        "tracking.tags.team=infra",
        "tracking.tags.note=a=b",  # only the first '=' splits
        "data.hub_config=wikitext-2-raw-v1",
    )
    assert cfg.model.n_layers == 3 and type(cfg.model.n_layers) is int
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.optim.min_lr == 1.5e-5
    assert cfg.optim.weight_decay == 0.0 and type(cfg.optim.weight_decay) is float
    assert cfg.routing.capacity == 1.0 and type(cfg.routing.capacity) is float
    assert cfg.model.tie_embeddings is False
    assert cfg.parallel.activation_checkpointing is True
    assert cfg.optim.betas == [0.8, 0.99] and all(type(b) is float for b in cfg.optim.betas)
    assert cfg.model.d_ff == 96
    assert cfg.train.max_tokens == 10**9 and type(cfg.train.max_tokens) is int
    assert cfg.train.max_flops == 2e18 and type(cfg.train.max_flops) is float
    assert cfg.tracking.tags == {"team": "infra", "note": "a=b"}
    assert cfg.data.hub_config == "wikitext-2-raw-v1"


def test_exponent_floats_in_yaml_files(tmp_path):
    p = write(tmp_path / "c.yaml", "optim:\n  lr: 1e-4\n  min_lr: 1E-5\n  eps: 1.0e-8\ntrain:\n  max_flops: 1e20\n")
    cfg = load_config(p)
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.eps, cfg.train.max_flops) == (1e-4, 1e-5, 1e-8, 1e20)


def test_override_null_resets_optional(tmp_path):
    p = write(tmp_path / "c.yaml", "model:\n  d_ff: 128\n")
    assert load_config(p).model.d_ff == 128
    assert load_config(p, ["model.d_ff=null"]).model.d_ff is None


def test_apply_overrides_does_not_mutate_input():
    raw = {"model": {"d_model": 64, "n_heads": 4}}
    out = apply_overrides(raw, ["model.d_model=128", "routing.capacity=0.5"])
    assert raw == {"model": {"d_model": 64, "n_heads": 4}}
    assert out == {"model": {"d_model": 128, "n_heads": 4}, "routing": {"capacity": 0.5}}


# ----------------------------------------------------------------------------- inheritance


def test_multi_level_inheritance_relative_to_including_file(tmp_path, monkeypatch):
    root = tmp_path / "configs"
    write(root / "base" / "model.yaml", """\
        name: grandparent
        model:
          d_model: 64
          n_heads: 4
          n_layers: 8
          vocab_size: 256
        data:
          tokenizer: {vocab_size: 256}
        optim:
          lr: 1.0e-3
          betas: [0.9, 0.95]
        tracking:
          tags: {owner: alice}
        """)
    write(root / "family" / "mod.yaml", """\
        base: ../base/model.yaml
        name: parent
        model:
          n_layers: 6
        routing:
          method: mod
          capacity: 0.25
        tracking:
          tags: {variant: mod}
        """)
    child = write(root / "exp" / "deep" / "run.yaml", """\
        base: ../../family/mod.yaml
        name: child
        routing:
          capacity: 0.5
        optim:
          betas: [0.8, 0.9]
        """)
    # relative paths resolve against the including file, not the working directory
    monkeypatch.chdir(tmp_path)
    cfg = load_config(os.path.relpath(child, tmp_path), ["model.n_layers=4"])
    assert cfg.name == "child"  # child overrides parent overrides grandparent
    assert cfg.model.d_model == 64 and cfg.model.n_heads == 4 and cfg.model.vocab_size == 256  # grandparent
    assert cfg.model.n_layers == 4  # command line beats every file
    assert cfg.routing.method == "mod" and cfg.routing.capacity == 0.5
    assert cfg.optim.lr == 1e-3  # deep merge keeps sibling keys
    assert cfg.optim.betas == [0.8, 0.9]  # lists are replaced, not merged
    assert cfg.tracking.tags == {"owner": "alice", "variant": "mod"}
    # without the override, the parent's n_layers wins over the grandparent's
    assert load_config(child).model.n_layers == 6
    assert "base" not in load_raw(child)


def test_absolute_base_path(tmp_path):
    parent = write(tmp_path / "elsewhere" / "p.yaml", "model:\n  d_model: 128\n  n_heads: 8\n")
    child = write(tmp_path / "here" / "c.yaml", f"base: {parent}\nmodel:\n  n_layers: 2\n")
    cfg = load_config(child)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers) == (128, 8, 2)


def test_error_in_parent_reports_key_path(tmp_path):
    write(tmp_path / "p.yaml", "routing:\n  capacity: 2.0\n")
    child = write(tmp_path / "c.yaml", "base: p.yaml\nname: c\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert_rejected(e, "routing.capacity", "(0, 1]")
    # ... and a child may fix its parent's value
    assert load_config(child, ["routing.capacity=0.5"]).routing.capacity == 0.5


# ----------------------------------------------------------------------------- round trip


def test_round_trip_default(tmp_path):
    cfg = Config().validate()
    path = str(tmp_path / "resolved.yaml")
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert to_yaml(again) == to_yaml(cfg)
    assert not os.path.exists(path + ".tmp")


def test_round_trip_non_trivial(make_config, tmp_path):
    cfg = make_config(
        "name='1e5'",  # quoted: a string that looks like a float must stay a string
        "variant=mod",
        "size=157m",
        "model.d_ff=96",
        "model.dtype=bfloat16",
        "model.tie_embeddings=false",
        "model.rope_theta=500000",
        "model.norm_eps=1e-6",
        "routing.method=mod",
        "routing.capacity=0.125",
        "routing.router_weight=sigmoid",
        "routing.causal_method=predictor",
        "optim.lr=3e-5",
        "optim.min_lr=3e-6",
        "optim.betas=[0.9, 0.999]",
        "optim.zero_stage=3",
        "optim.offload_params=true",
        "optim.schedule=wsd",
        "train.max_flops=1.5e20",
        "train.max_tokens=123456789",
        "train.precision=bf16",
        "data.hub_config=null",
        "data.tokenizer.kind=file",
        "data.tokenizer.path=tok/sp.model",
        "checkpoint.init_from=runs/dense/checkpoints/latest",
        "tracking.uri=http://127.0.0.1:5000",
        "tracking.tags.sweep='0042'",  # quoted: stays a string with its leading zeros
        "tracking.tags.yes='true'",
    )
    assert cfg.name == "1e5" and cfg.tracking.tags == {"sweep": "0042", "yes": "true"}
    assert cfg != make_config()
    path = str(tmp_path / "runs" / "x" / "config.yaml")
    save_config(cfg, path)
    again = load_config(path)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)
    assert config_hash(again) != config_hash(make_config())
    # the written file is plain YAML any tool can read
    with open(path) as f:
        assert yaml.safe_load(f)["routing"]["capacity"] == 0.125


def test_config_from_dict_equals_load(make_config):
    cfg = make_config("routing.method=mod")
    assert config_from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


def test_flatten_dotted_keys(make_config):
    flat = flatten(make_config("tracking.tags.team=infra"))
    assert flat["model.d_model"] == 32
    assert flat["data.tokenizer.vocab_size"] == 97
    assert flat["tracking.tags.team"] == "infra"
    assert flat["optim.betas"] == [0.9, 0.95]


def test_section_properties():
    assert ModelConfig(d_model=384, n_heads=6).head_dim == 64
    assert ModelConfig(d_model=384).ffn_hidden == 1024  # 8/3 * 384 = 1024, a multiple of 64
    assert ModelConfig(d_model=100, ffn_multiple_of=64).ffn_hidden == 320  # 266 rounded up
    assert ModelConfig(d_ff=77).ffn_hidden == 77
    assert OptimConfig().betas is not OptimConfig().betas  # no shared mutable defaults


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_main(monkeypatch):
    # Only the config subcommand: this unit test must not depend on the data/inspect modules.
    monkeypatch.setattr(megaroute.cli, "SUBCOMMANDS", {"config": "megaroute.config.cli"})
    return megaroute.cli.main


def test_cli_config_show(cli_main, tmp_path, capsys):
    p = write(tmp_path / "c.yaml", "model:\n  d_model: 64\n  n_heads: 4\n")
    assert cli_main(["config", "show", "--config", p, "model.n_layers=3", "optim.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    shown = config_from_dict(yaml.safe_load(out))
    assert shown == load_config(p, ["model.n_layers=3", "optim.lr=1e-4"])
    assert (shown.model.d_model, shown.model.n_layers, shown.optim.lr) == (64, 3, 1e-4)


def test_cli_config_show_overrides_before_config(cli_main, tmp_path, capsys):
    p = write(tmp_path / "c.yaml", "model:\n  d_model: 64\n  n_heads: 4\n")
    assert cli_main(["config", "show", "model.n_layers=2", "--config", p]) == 0
    shown = config_from_dict(yaml.safe_load(capsys.readouterr().out))
    assert (shown.model.d_model, shown.model.n_layers) == (64, 2)


def test_cli_config_show_defaults(cli_main, capsys):
    assert cli_main(["config", "show"]) == 0
    assert config_from_dict(yaml.safe_load(capsys.readouterr().out)) == Config()


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["model.n_layer=3"], ["model.n_layer", "did you mean 'n_layers'"]),
        (["routing.capacity=1.5"], ["routing.capacity", "(0, 1]"]),
        (["model.d_model"], ["key.path=value"]),
    ],
)
def test_cli_config_show_bad_input(cli_main, capsys, args, fragments):
    assert cli_main(["config", "show", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    for fragment in fragments:
        assert fragment in captured.err


def test_cli_missing_file(cli_main, capsys, tmp_path):
    assert cli_main(["config", "show", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
