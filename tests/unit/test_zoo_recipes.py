"""Recipe cards: every shipped card validates, and every kind of mistake is a clear ValueError."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from qaccel.fsdp import QSDPConfig
from qaccel.optim import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.zoo import list_recipes, load_recipe, recipe_names
from qaccel.zoo.recipes import model_cards_dir, parse_card, recipe_from_dict

SHIPPED = [
    "bert-base",
    "bert-base-mrpc-qsdp",
    "bert-base-mrpc-zero-one-adam",
    "bert-large",
    "bert-tiny",
    "gpt2-1.3b",
    "gpt2-124m",
    "gpt2-124m-lowbit",
    "gpt2-124m-w4g4",
    "gpt2-350m",
    "gpt2-tiny",
    "gpt2-tiny-diloco",
    "minilm-finetune",
    "minilm-finetune-lora",
]


def _front_matter(name: str) -> dict:
    """The card's YAML, parsed here with PyYAML directly (independent of the loader)."""
    text = (model_cards_dir() / f"{name}.md").read_text()
    _, front, _ = text.split("---\n", 2)
    return yaml.safe_load(front)


@pytest.fixture
def tiny() -> dict:
    return _front_matter("gpt2-tiny")


def test_the_shipped_recipes_are_exactly_the_documented_ones():
    assert recipe_names() == SHIPPED
    assert [r.name for r in list_recipes()] == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_loads_and_matches_its_yaml(name):
    recipe = load_recipe(name)
    raw = _front_matter(name)
    assert recipe.name == name == recipe.path.stem
    assert recipe.task == raw["task"] and recipe.summary == raw["summary"]
    assert recipe.training.max_steps == raw["training"]["max_steps"]
    assert recipe.training.learning_rate == pytest.approx(float(raw["training"]["learning_rate"]))
    assert recipe.method.name == raw["method"]["name"]
    assert recipe.launch.config == raw["launch"]["config"]
    assert recipe.launch_config_path().is_file(), f"{name}: launch file {recipe.launch.config} is missing"
    assert recipe.card_body.lstrip().startswith("#"), "the prose (future model card) starts with a heading"
    assert json.loads(json.dumps(recipe.to_dict()))["name"] == name


@pytest.mark.parametrize("name", SHIPPED)
def test_method_sections_are_valid_configs_of_the_real_classes(name):
    method = load_recipe(name).method
    raw = _front_matter(name)["method"]
    qsdp = QSDPConfig(**method.qsdp)  # keyword arguments, as scripts/train.py builds them
    zoadam = ZeroOneAdamConfig(**method.zero_one_adam)
    onebit = OneBitAdamConfig(**method.onebit_adam)
    assert (qsdp, zoadam, onebit) == (QSDPConfig.from_dict(method.qsdp), ZeroOneAdamConfig.from_dict(method.zero_one_adam), OneBitAdamConfig.from_dict(method.onebit_adam))
    for key, value in raw.get("qsdp", {}).items():
        assert getattr(qsdp, key) == value
    for key, value in raw.get("zero_one_adam", {}).items():
        assert getattr(zoadam, key) == (tuple(value) if isinstance(value, list) else value)
    for key, value in raw.get("onebit_adam", {}).items():
        assert getattr(onebit, key) == (tuple(value) if isinstance(value, list) else value)


def test_paper_settings_of_the_gpu_recipes():
    """The numbers the cards' prose cites (QSDP paper batches, DeepSpeed's 0/1 Adam BERT config)."""
    for name, gpus, global_batch in (("gpt2-124m", 8, 256), ("gpt2-350m", 8, 256), ("gpt2-1.3b", 16, 512)):
        r = load_recipe(name)
        assert r.launch.num_processes == gpus
        assert gpus * r.training.per_device_batch_size * r.training.gradient_accumulation_steps == global_batch
        assert r.training.gradient_accumulation_steps == 4
        assert r.method.qsdp == {"weight_bits": 8, "grad_bits": 8}
    assert load_recipe("gpt2-124m-w4g4").method.qsdp == {"weight_bits": 4, "grad_bits": 4}
    # the low-bit recipe is the documented preset
    from qaccel.fsdp import QSDPConfig

    assert QSDPConfig(**load_recipe("gpt2-124m-lowbit").method.qsdp) == QSDPConfig.preset("w3g2-nearest")
    for name in ("bert-base", "bert-large"):
        r = load_recipe(name)
        assert 8 * r.training.per_device_batch_size * r.training.gradient_accumulation_steps == 4096
        z = r.method.zero_one_adam
        assert (z["var_freeze_step"], z["var_update_scaler"], z["local_step_scaler"], z["local_step_clipper"]) == (12500, 16, 32678, 16)
        assert r.training.learning_rate == 4e-4 and r.training.weight_decay == 0.01


@pytest.mark.parametrize("name", ["bert-tiny", "minilm-finetune"])
def test_cpu_0_1_adam_recipes_reach_every_phase_within_their_run(name):
    """Variance steps, 1-bit gradient steps, syncs and silent local steps all occur in max_steps."""
    from qaccel.optim import StepKind, ZeroOneAdamSchedule, count_step_kinds

    r = load_recipe(name)
    z = r.method.zero_one_adam
    keys = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    counts = count_step_kinds(lambda: ZeroOneAdamSchedule(**{k: z[k] for k in keys}), r.training.max_steps)
    for kind in (StepKind.INIT, StepKind.FULL, StepKind.ONEBIT_GRADIENT, StepKind.SYNC, StepKind.LOCAL):
        assert counts[kind] > 0, (kind, counts)
    assert sum(counts.values()) == r.training.max_steps


def test_unknown_recipe_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'gpt3'") as err:
        load_recipe("gpt3")
    for name in SHIPPED:
        assert name in str(err.value)


def test_unknown_top_level_key(tiny):
    tiny["optimiser"] = "adam"
    with pytest.raises(ValueError, match=r"unknown key optimiser; valid keys of the front matter: name, summary, task"):
        recipe_from_dict(tiny)


def test_unknown_nested_key_names_the_section_and_its_valid_keys(tiny):
    tiny["training"]["learning_rte"] = 1e-3
    with pytest.raises(ValueError, match=r"unknown key training\.learning_rte; valid keys of training: max_steps, .*mixed_precision"):
        recipe_from_dict(tiny)


def test_missing_key(tiny):
    del tiny["launch"]["num_processes"]
    with pytest.raises(ValueError, match=r"missing key launch\.num_processes"):
        recipe_from_dict(tiny)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("", "task", "regression", r"task='regression': must be one of 'causal-lm', 'masked-lm', 'sequence-classification'"),
        ("dataset", "name", "c4", r"dataset\.name='c4': must be one of 'stdlib-text'"),
        ("dataset", "seq_len", "128", r"dataset\.seq_len='128': must be an integer"),
        ("dataset", "eval_fraction", 0.0, r"dataset\.eval_fraction=0\.0: must be a number > 0, <= 0\.5"),
        ("training", "max_steps", True, r"training\.max_steps=True: must be an integer"),
        ("training", "learning_rate", "1e-3", r"YAML reads 1e-3 as a string: write 1\.0e-3"),
        ("training", "mixed_precision", False, r"quote it, e\.g\. 'no'"),
        ("training", "lr_scheduler", "cosinus", r"training\.lr_scheduler='cosinus': must be one of linear, cosine"),
        ("training", "mlm_probability", 0.15, r"training\.mlm_probability=0\.15: must be null for task 'causal-lm'"),
        ("method", "name", "lamb", r"method\.name='lamb': must be one of 'qsdp', 'zero_one_adam', 'onebit_adam', 'diloco', 'none'"),
        ("launch", "config", "/abs/cpu.yaml", r"launch\.config='/abs/cpu\.yaml': must be a launch config that ships with qaccel: launch_configs/<cpu_2proc_ddp\|cpu_2proc_qsdp\|"),
        ("tokenizer", "kind", "sentencepiece", r"tokenizer\.kind='sentencepiece': must be one of 'bpe', 'wordpiece' or null"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(tiny, section, key, value, message):
    (tiny[section] if section else tiny)[key] = value
    with pytest.raises(ValueError, match=message) as err:
        recipe_from_dict(tiny)
    assert "recipe 'gpt2-tiny'" in str(err.value)


def test_method_sections_are_checked_by_the_config_classes(tiny):
    bad_bits = copy.deepcopy(tiny)
    bad_bits["method"]["qsdp"]["weight_bits"] = 12
    with pytest.raises(ValueError, match=r"method\.qsdp: QSDPConfig\.weight_bits=12: must be an int in \[2, 8\]"):
        recipe_from_dict(bad_bits)
    unknown = copy.deepcopy(tiny)
    unknown["method"]["zero_one_adam"] = {"var_freeze_steps": 10}
    with pytest.raises(ValueError, match=r"method\.zero_one_adam: ZeroOneAdamConfig\.from_dict: unknown keys \['var_freeze_steps'\]"):
        recipe_from_dict(unknown)
    unsupported = copy.deepcopy(tiny)
    unsupported["method"]["onebit_adam"] = {"comm_backend_name": "mpi"}
    with pytest.raises(ValueError, match=r"method\.onebit_adam: OneBitAdamConfig\.comm_backend_name='mpi'"):
        recipe_from_dict(unsupported)


def test_model_config_keys_are_checked_against_the_model_type(tiny):
    tiny["model"]["config"]["n_layers"] = 4  # GPT-2 calls it n_layer
    with pytest.raises(ValueError, match=r"unknown key model\.config\.n_layers for model_type 'gpt2'; valid keys: .*n_layer"):
        recipe_from_dict(tiny)
    tiny["model"]["config"] = {"model_type": "gpt9"}
    with pytest.raises(ValueError, match=r"model\.config\.model_type='gpt9'"):
        recipe_from_dict(tiny)


def test_cross_field_rules(tiny):
    both = copy.deepcopy(tiny)
    both["model"]["name_or_path"] = "gpt2"
    with pytest.raises(ValueError, match="set exactly one of name_or_path"):
        recipe_from_dict(both)
    no_vocab = copy.deepcopy(tiny)
    no_vocab["tokenizer"]["vocab_size"] = None
    with pytest.raises(ValueError, match="kind .* and vocab_size must be set to train one"):
        recipe_from_dict(no_vocab)
    pretrained = copy.deepcopy(tiny)
    pretrained["tokenizer"]["name_or_path"] = "openai-community/gpt2"
    with pytest.raises(ValueError, match="kind and vocab_size only apply to a tokenizer trained here"):
        recipe_from_dict(pretrained)
    wrong_data = copy.deepcopy(tiny)
    wrong_data["dataset"]["name"] = "stdlib-topics"
    with pytest.raises(ValueError, match=r"dataset\.name='stdlib-topics': must be a dataset for task 'causal-lm': stdlib-text, local-text"):
        recipe_from_dict(wrong_data)
    no_files = copy.deepcopy(tiny)
    no_files["dataset"]["name"] = "local-text"
    with pytest.raises(ValueError, match=r"dataset\.data_files: required"):
        recipe_from_dict(no_files)
    long_warmup = copy.deepcopy(tiny)
    long_warmup["training"]["warmup_steps"] = 301
    with pytest.raises(ValueError, match=r"training\.warmup_steps=301: must be <= training\.max_steps \(300\)"):
        recipe_from_dict(long_warmup)


def test_defaults_are_filled_in(tiny):
    for key in ("gradient_accumulation_steps", "weight_decay", "warmup_steps", "lr_scheduler", "seed", "eval_steps", "save_steps", "mixed_precision"):
        del tiny["training"][key]
    del tiny["expected"], tiny["method"]["qsdp"]
    r = recipe_from_dict(tiny)
    t = r.training
    assert (t.gradient_accumulation_steps, t.weight_decay, t.warmup_steps, t.lr_scheduler, t.seed) == (1, 0.0, 0, "linear", 0)
    assert t.eval_steps == t.save_steps == t.max_steps == 300
    assert (t.mixed_precision, t.mlm_probability, r.expected, r.method.qsdp) == ("no", None, {}, {})
    assert load_recipe("bert-tiny").training.mlm_probability == 0.15


def test_card_format_errors(tmp_path):
    with pytest.raises(ValueError, match="must start with a '---' line"):
        parse_card("# no front matter\n", "card")
    with pytest.raises(ValueError, match="no closing '---'"):
        parse_card("---\nname: x\n", "card")
    with pytest.raises(ValueError, match="invalid YAML"):
        parse_card("---\nname: [x\n---\n", "card")


def test_a_recipe_file_by_path_and_the_name_must_match_the_stem(tmp_path, tiny):
    path = tmp_path / "my-gpt.yaml"
    tiny["name"] = "my-gpt"
    path.write_text(yaml.safe_dump(tiny))
    recipe = load_recipe(str(path))
    assert recipe.name == "my-gpt" and recipe.card_body == "" and recipe.path == path
    other = tmp_path / "other.md"
    other.write_text("---\n" + yaml.safe_dump(tiny) + "---\n# prose\n")
    with pytest.raises(ValueError, match="name='my-gpt': must equal the file name stem 'other'"):
        load_recipe(str(other))
    with pytest.raises(ValueError, match="no such file"):
        load_recipe(str(tmp_path / "missing.md"))


def test_cards_folder_override(tmp_path, monkeypatch):
    source = model_cards_dir() / "gpt2-tiny.md"
    (tmp_path / "gpt2-tiny.md").write_text(source.read_text())
    monkeypatch.setenv("QACCEL_MODEL_CARDS", str(tmp_path))
    assert recipe_names() == ["gpt2-tiny"]
    assert load_recipe("gpt2-tiny").path == tmp_path / "gpt2-tiny.md"
    monkeypatch.setenv("QACCEL_MODEL_CARDS", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="QACCEL_MODEL_CARDS"):
        recipe_names()


def test_default_cards_folder_in_a_checkout_is_the_one_beside_the_package():
    import qaccel

    assert model_cards_dir() == Path(qaccel.__file__).resolve().parents[1] / "model_cards"


# -- dataset sections that name a `datasets` source ------------------------------------------

# The card key -> the DataSource field / training-script flag, spelled out here as docs/zoo.md states it.
CARD_TO_SOURCE = {"path": "dataset_name", "config_name": "dataset_config_name", "revision": "dataset_revision", "seq_len": "max_seq_length"}
# GLUE MRPC on the Hub (nyu-mll/glue, config mrpc), from its dataset card: features and split sizes.
MRPC_FEATURES = {"sentence1": "string", "sentence2": "string", "label": ("not_equivalent", "equivalent"), "idx": "int32"}
MRPC_SPLITS = {"train": 3668, "validation": 408, "test": 1725}
MRPC_RECIPES = ["bert-base-mrpc-qsdp", "bert-base-mrpc-zero-one-adam"]


@pytest.fixture
def mrpc() -> dict:
    return _front_matter("bert-base-mrpc-qsdp")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_dataset_section_validates_offline_and_matches_its_yaml(name, monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("loading a recipe must not reach the Hub")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", no_network)
    recipe = load_recipe(name)
    raw = _front_matter(name)["dataset"]
    section = recipe.front_matter()["dataset"]
    for key, value in raw.items():
        assert section[key] == value, (name, key)
    if raw["name"] != "datasets":
        assert recipe.dataset.source is None and recipe.dataset.eval_fraction == raw["eval_fraction"]
        return
    source = recipe.dataset.source
    assert recipe.dataset.eval_fraction is None and source.max_seq_length == recipe.dataset.seq_len == raw["seq_len"]
    for key, value in raw.items():
        if key != "name":
            assert getattr(source, CARD_TO_SOURCE.get(key, key)) == value, (name, key)


@pytest.mark.parametrize("name", MRPC_RECIPES)
def test_mrpc_recipes_use_glue_mrpc_columns_and_bert_glue_hyperparameters(name):
    recipe = load_recipe(name)
    source = recipe.dataset.source
    assert recipe.task == "sequence-classification" and recipe.model.name_or_path == "google-bert/bert-base-uncased"
    assert (source.dataset_name, source.dataset_config_name) == ("nyu-mll/glue", "mrpc")
    assert {source.text_column, source.text_pair_column, source.label_column} <= set(MRPC_FEATURES)
    assert MRPC_FEATURES[source.text_column] == MRPC_FEATURES[source.text_pair_column] == "string"
    assert isinstance(MRPC_FEATURES[source.label_column], tuple)  # the ClassLabel: two classes, F1 of class 1
    assert source.train_split in MRPC_SPLITS and source.validation_split in MRPC_SPLITS and source.validation_split != "test"
    # BERT's GLUE recipe: lr 2e-5, batch 32, 3 epochs, 128 tokens, 10% warm-up.
    t, n = recipe.training, recipe.launch.num_processes
    assert t.learning_rate == 2e-5 and recipe.dataset.seq_len == 128
    assert n * t.per_device_batch_size * t.gradient_accumulation_steps == 32
    steps_per_epoch = MRPC_SPLITS["train"] // t.per_device_batch_size // n  # drop_last batches, dealt round-robin to n processes
    assert t.max_steps == 3 * steps_per_epoch == 342 and t.eval_steps == steps_per_epoch
    assert t.warmup_steps == round(0.1 * t.max_steps)
    suffix = "_qsdp.yaml" if recipe.method.name == "qsdp" else "_ddp.yaml"  # QSDP on FSDP2, 0/1 Adam on DDP
    assert recipe.launch.config.endswith(suffix) and recipe.launch_config_path().is_file()
    assert "not run by the project" in recipe.expected["status"] and "has not been run by the project" in recipe.card_body


def test_mrpc_zero_one_adam_step_counts_are_the_ones_its_card_states():
    from qaccel.optim import StepKind, ZeroOneAdamSchedule, count_step_kinds

    r = load_recipe("bert-base-mrpc-zero-one-adam")
    z = r.method.zero_one_adam
    keys = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    counts = count_step_kinds(lambda: ZeroOneAdamSchedule(**{k: z[k] for k in keys}), r.training.max_steps)
    assert z["var_freeze_step"] == r.training.warmup_steps
    assert (counts[StepKind.FULL], counts[StepKind.ONEBIT_GRADIENT], counts[StepKind.SYNC], counts[StepKind.LOCAL]) == (25, 9, 109, 198)
    for number in ("25 steps", "9\n  more steps", "109 steps", "198\n  local steps"):
        assert number in r.card_body, number


@pytest.mark.parametrize("name", MRPC_RECIPES)
def test_resolve_recipe_turns_the_section_into_the_runs_data_source(name, tmp_path):
    from qaccel.train import parse_args, resolve_recipe

    raw = _front_matter(name)["dataset"]
    recipe, source = resolve_recipe(parse_args(["--recipe", name, "--output_dir", str(tmp_path)]))
    for key, value in raw.items():
        if key != "name":
            assert getattr(source, CARD_TO_SOURCE.get(key, key)) == value, key
    assert recipe.dataset.source == source and source.hub_id == raw["path"]
    # A flag overrides its own setting only.
    _, pinned = resolve_recipe(parse_args(["--recipe", name, "--output_dir", str(tmp_path), "--dataset_revision", "abc123", "--max_seq_length", "64", "--validation_split", "test"]))
    assert (pinned.dataset_revision, pinned.max_seq_length, pinned.validation_split) == ("abc123", 64, "test")
    assert (pinned.dataset_name, pinned.dataset_config_name, pinned.text_pair_column) == (raw["path"], raw["config_name"], raw["text_pair_column"])
    # Another place (local files) replaces the whole location; the column mapping still applies.
    _, local = resolve_recipe(parse_args(["--recipe", name, "--output_dir", str(tmp_path), "--train_file", "mrpc.csv"]))
    assert (local.dataset_name, local.dataset_config_name, local.train_file) == (None, None, "mrpc.csv")
    assert (local.text_column, local.text_pair_column, local.label_column) == (raw["text_column"], raw["text_pair_column"], raw["label_column"])


def test_a_builtin_recipe_still_takes_no_column_flags_without_a_dataset(tmp_path):
    from qaccel._errors import UsageError
    from qaccel.train import parse_args, resolve_recipe

    _, source = resolve_recipe(parse_args(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path)]))
    assert source is None
    with pytest.raises(UsageError, match=r"--train_split: applies to a dataset given with --dataset_name or --train_file"):
        resolve_recipe(parse_args(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path), "--train_split", "fit"]))


def test_a_datasets_section_round_trips_through_the_resolved_settings(mrpc):
    recipe = recipe_from_dict(mrpc)
    again = recipe_from_dict(json.loads(json.dumps(recipe.front_matter())))
    assert again.dataset == recipe.dataset and again.front_matter() == recipe.front_matter()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"config": "mrpc"}, r"unknown key dataset\.config; valid keys of dataset: name, seq_len, path, config_name, revision"),
        ({"seq_len": "128"}, r"dataset\.seq_len='128': must be an integer"),
        ({"streaming": "yes"}, r"dataset\.streaming='yes': must be true or false"),
        ({"validation_split_percentage": 100}, r"dataset\.validation_split_percentage=100\.0: must be a number > 0, < 100 or null"),
        ({"label_column": 1}, r"dataset\.label_column=1: must be a string or null"),
        ({"path": None}, r"dataset: set exactly one of path .* and train_file"),
        ({"train_file": "train.csv"}, r"dataset: set exactly one of path .* and train_file"),
        ({"path": None, "train_file": "train.csv"}, r"dataset\.config_name='mrpc': must be absent with dataset\.train_file"),
        ({"path": None, "config_name": None, "revision": None, "train_split": None, "validation_split": None, "train_file": "train.xlsx"}, r"dataset\.train_file='train\.xlsx': must be a file of a format datasets reads: \.csv"),
        ({"validation_file": "dev.csv"}, r"dataset\.validation_file='dev\.csv': must be null with dataset\.path"),
        ({"validation_split_percentage": 10}, r"dataset\.validation_split='validation': must be absent with dataset\.validation_split_percentage"),
        ({"text_pair_column": "sentence1"}, r"dataset\.text_pair_column='sentence1': must be a column other than dataset\.text_column's"),
        ({"streaming": True}, r"dataset\.streaming=True: must be false for task 'sequence-classification'"),
        ({"streaming_shuffle_buffer": 100}, r"dataset\.streaming_shuffle_buffer=100: must be null without dataset\.streaming"),
        ({"eval_fraction": 0.1}, r"unknown key dataset\.eval_fraction; valid keys of dataset: name, seq_len, path"),
    ],
)
def test_bad_datasets_sections_name_the_key(mrpc, changes, message):
    for key, value in changes.items():
        if value is None and key not in ("path",):
            mrpc["dataset"].pop(key, None)
        else:
            mrpc["dataset"][key] = value
    with pytest.raises(ValueError, match=message) as err:
        recipe_from_dict(mrpc)
    assert "recipe 'bert-base-mrpc-qsdp'" in str(err.value)


@pytest.mark.parametrize("key", ["text_pair_column", "label_column"])
def test_a_column_mapping_must_fit_the_task(mrpc, key):
    mrpc["task"] = "masked-lm"
    mrpc["dataset"] = {"name": "datasets", "path": "wikimedia/wikipedia", "config_name": "20231101.en", "text_column": "text", key: "other", "seq_len": 128}
    with pytest.raises(ValueError, match=rf"dataset\.{key}='other': must be null for task 'masked-lm' \(it applies to sequence-classification\)"):
        recipe_from_dict(mrpc)
    del mrpc["dataset"][key]
    assert recipe_from_dict(mrpc).dataset.source.text_column == "text"  # the same section without it is fine


def test_a_datasets_section_needs_a_pretrained_tokenizer(tiny):
    tiny["dataset"] = {"name": "datasets", "path": "Skylion007/openwebtext", "seq_len": 128}
    with pytest.raises(ValueError, match=r"tokenizer: with dataset\.name 'datasets', set tokenizer\.name_or_path"):
        recipe_from_dict(tiny)


def test_builtin_sections_keep_their_keys(mrpc, tiny):
    tiny["dataset"]["path"] = "nyu-mll/glue"
    with pytest.raises(ValueError, match=r"unknown key dataset\.path; valid keys of dataset: name, seq_len, eval_fraction, max_train_examples, data_files"):
        recipe_from_dict(tiny)
    mrpc["dataset"] = {"name": "stdlib-text", "seq_len": 128, "eval_fraction": 0.1}
    with pytest.raises(ValueError, match=r"dataset\.name='stdlib-text': must be a dataset for task 'sequence-classification': stdlib-topics, datasets"):
        recipe_from_dict(mrpc)


def test_a_datasets_section_has_one_documented_key_per_data_source_setting(mrpc):
    """Each DataSource field (each dataset flag) is a key of the section, and docs/zoo.md's key table lists it."""
    import dataclasses
    import re

    from qaccel.zoo.user_data import DataSource

    section = recipe_from_dict(mrpc).front_matter()["dataset"]
    fields = {f.name for f in dataclasses.fields(DataSource)}
    assert {CARD_TO_SOURCE.get(key, key) for key in section if key != "name"} == fields
    table = (Path(__file__).resolve().parents[2] / "docs" / "zoo.md").read_text()
    documented = set(re.findall(r"`dataset\.([a-z_]+)`", table))
    assert set(section) <= documented, set(section) - documented


# -- the papers' pre-training recipes, streamed from the Hub -----------------------------------

# recipe -> (Hub dataset, config, validation split, pretrained tokenizer): the QSDP paper's GPT models
# train on C4 (docs: /work/shared/design/qsdp.md section 1); the 0/1 Adam paper's BERT on English
# Wikipedia (BookCorpus has no clearly licensed Hub copy), which has only a train split.
C4 = ("allenai/c4", "en", "validation", "openai-community/gpt2")
WIKIPEDIA = ("wikimedia/wikipedia", "20231101.en", "train", "google-bert/bert-base-uncased")
STREAMED = {"gpt2-124m": C4, "gpt2-124m-w4g4": C4, "gpt2-124m-lowbit": C4, "gpt2-350m": C4, "gpt2-1.3b": C4, "bert-base": WIKIPEDIA, "bert-large": WIKIPEDIA}


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_pretraining_recipes_stream_the_papers_corpus_with_a_pretrained_tokenizer(name, tmp_path):
    from qaccel.train import parse_args, resolve_recipe

    path, config, validation_split, tokenizer = STREAMED[name]
    raw = _front_matter(name)
    data, training = raw["dataset"], raw["training"]
    assert (data["name"], data["path"], data["config_name"], data["text_column"]) == ("datasets", path, config, "text")
    assert data["streaming"] is True and data["validation_split"] == validation_split and data["max_eval_samples"] >= 1
    assert raw["tokenizer"] == {"name_or_path": tokenizer} and raw["model"]["name_or_path"] is None  # from config, tokenizer not trained
    assert raw["task"] == ("causal-lm" if name.startswith("gpt2") else "masked-lm")
    assert data["seq_len"] == (2048 if name.startswith("gpt2") else 128)  # BERT: the 128-token phase
    # The stated token count, from the YAML's own numbers.
    tokens = training["max_steps"] * training["per_device_batch_size"] * training["gradient_accumulation_steps"] * raw["launch"]["num_processes"] * data["seq_len"]
    assert raw["expected"]["tokens_seen"] == tokens
    body = (model_cards_dir() / f"{name}.md").read_text().split("---\n", 2)[2]
    assert f"{tokens:,} tokens" in body and path in body and "has not run here" in body
    # What a run gets: a streaming source for that corpus, and the pretrained tokenizer.
    recipe, source = resolve_recipe(parse_args(["--recipe", name, "--output_dir", str(tmp_path)]))
    assert (source.dataset_name, source.dataset_config_name, source.streaming, source.validation_split) == (path, config, True, validation_split)
    assert recipe.tokenizer.name_or_path == tokenizer and recipe.tokenizer.kind is None
