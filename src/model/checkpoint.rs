//! Checkpoints: a directory with `config.json` (the model, the run's options, its progress
//! and its data) and one `stage-K.safetensors` file per pipeline stage (parameters and
//! AdamW moments of that stage, its step count in the metadata). The format is documented
//! in docs/CHECKPOINT.md.
//!
//! Each stage file stands on its own (it names its model, stage, plan and step, and carries
//! a checksum of its tensors) so that in a swarm the nodes serving stage K can write
//! stage K's file without the others; [`write_stage_file`] is that writer. Every file is
//! written to a temporary file in the same directory, flushed to disk, then renamed: a
//! reader sees the old file or the new one, never a part.
use super::config::{
    block_tensors, embedding_tensors, head_tensors, ModelConfig, StagePlan, StageSpec, TensorSpec,
};
use super::dataset::DataDescription;
use super::kernels::AdamW;
use super::stage::{bytes_to_f32s, f32s_to_bytes, StageState, StateParts};
use super::train::{Progress, TrainOptions};
use super::ModelError;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `format` of `config.json`.
pub const FORMAT: &str = "gwtf-checkpoint";
/// `format` in a stage file's metadata.
pub const STAGE_FORMAT: &str = "gwtf-stage";
/// Version of both (a reader refuses other versions).
pub const VERSION: u32 = 1;
/// Name of the config file in a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// In a directory of swarm checkpoints (`gwtf node --save DIR`), the file
/// that names the newest one.
pub const LATEST_FILE: &str = "LATEST";

/// The checkpoint `dir` names: `dir` itself when it holds a checkpoint (or
/// nothing else), else the newest checkpoint of a directory of them (the
/// one its `LATEST` file names).
pub fn resolve(dir: &Path) -> Result<PathBuf, ModelError> {
    let latest = dir.join(LATEST_FILE);
    if dir.join(CONFIG_FILE).exists() || !latest.exists() {
        return Ok(dir.to_path_buf());
    }
    let text =
        std::fs::read_to_string(&latest).map_err(|e| err(&latest, format!("cannot read: {e}")))?;
    let name = text.trim();
    let p = Path::new(name);
    if name.is_empty() || name.starts_with('.') || p.components().count() != 1 {
        return Err(err(&latest, format!("{name:?} is not a checkpoint's name")));
    }
    Ok(dir.join(p))
}

/// Name of stage `k`'s file in a checkpoint directory.
pub fn stage_file_name(k: usize) -> String {
    format!("stage-{k}.safetensors")
}

fn err(path: &Path, msg: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint(format!("{}: {msg}", path.display()))
}

/// The first field in which two configs differ, as `field: a vs b` (to say why a
/// checkpoint does not fit).
pub fn config_difference(a: &ModelConfig, b: &ModelConfig) -> Option<String> {
    let a = serde_json::to_value(a).ok()?;
    let b = serde_json::to_value(b).ok()?;
    let (a, b) = (a.as_object()?, b.as_object()?);
    a.iter()
        .find(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v} vs {}", b.get(k).cloned().unwrap_or_default()))
}

/// The run's options, as `config.json` records them (what a resumed run must reuse).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingDesc {
    /// Horizon of the learning-rate schedule (steps of the whole run).
    pub schedule_steps: usize,
    /// Warmup steps.
    pub warmup: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Microbatches per optimizer step.
    pub accum: usize,
    /// AdamW weight decay.
    pub weight_decay: f32,
    /// AdamW beta1.
    pub beta1: f32,
    /// AdamW beta2.
    pub beta2: f32,
    /// AdamW epsilon.
    pub eps: f32,
}

/// One stage as `config.json` lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageEntry {
    /// Stage index.
    pub index: usize,
    /// File name in the checkpoint directory.
    pub file: String,
    /// Holds the embedding.
    pub embedding: bool,
    /// Global indices of its blocks, `[start, end)`.
    pub blocks: [usize; 2],
    /// Holds the final norm and head.
    pub head: bool,
    /// Parameters.
    pub params: usize,
}

/// `config.json` of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointConfig {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`].
    pub version: u32,
    /// The model: its shape, and the run's stage count (`n_stages`) and microbatch shape
    /// (`batch` sequences of `seq` tokens).
    pub model: ModelConfig,
    /// The stages and their files.
    pub stages: Vec<StageEntry>,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Optimizer steps taken.
    pub steps_done: usize,
    /// Position of the training-window sampler's random stream.
    pub data_rng_state: u64,
    /// The run's options.
    pub training: TrainingDesc,
    /// What it was trained on.
    pub data: DataDescription,
    /// Held-out loss when it was saved, if measured.
    pub heldout_loss: Option<f32>,
}

impl CheckpointConfig {
    /// The config of a run of `cfg` with options `o` on `data`, at `progress`.
    pub fn new(
        cfg: &ModelConfig,
        o: &TrainOptions,
        data: &DataDescription,
        progress: &Progress,
    ) -> Result<CheckpointConfig, ModelError> {
        let mut c = cfg.clone();
        c.n_stages = o.stages;
        c.batch = o.batch;
        c.seq = o.seq;
        c.validate()?;
        let plan = StagePlan::new(&c, o.stages)?;
        let opt = AdamW::default();
        Ok(CheckpointConfig {
            format: FORMAT.into(),
            version: VERSION,
            stages: plan
                .stages
                .iter()
                .map(|s| StageEntry {
                    index: s.index,
                    file: stage_file_name(s.index),
                    embedding: s.embedding,
                    blocks: [s.blocks.start, s.blocks.end],
                    head: s.head,
                    params: stage_tensors(&c, s).iter().map(|t| t.spec.len).sum(),
                })
                .collect(),
            seed: o.seed,
            steps_done: progress.steps_done,
            data_rng_state: progress.data_rng_state,
            training: TrainingDesc {
                schedule_steps: o.steps,
                warmup: o.warmup,
                lr: o.lr,
                accum: o.accum,
                weight_decay: o.weight_decay,
                beta1: opt.beta1,
                beta2: opt.beta2,
                eps: opt.eps,
            },
            data: data.clone(),
            heldout_loss: None,
            model: c,
        })
    }

    /// The model config (with the run's stages and microbatch shape), validated.
    pub fn model_config(&self) -> Result<ModelConfig, ModelError> {
        self.model.validate()?;
        Ok(self.model.clone())
    }

    /// The run's options (`corpus_bytes` from the data description when generated).
    pub fn options(&self) -> TrainOptions {
        let t = &self.training;
        TrainOptions {
            steps: t.schedule_steps,
            seed: self.seed,
            lr: t.lr,
            warmup: t.warmup,
            batch: self.model.batch,
            seq: self.model.seq,
            accum: t.accum,
            stages: self.model.n_stages,
            corpus_bytes: match &self.data {
                DataDescription::Synthetic { bytes, .. } => *bytes,
                DataDescription::Files { .. } => 0,
            },
            weight_decay: t.weight_decay,
        }
    }

    /// The progress it records.
    pub fn progress(&self) -> Progress {
        Progress {
            steps_done: self.steps_done,
            data_rng_state: self.data_rng_state,
        }
    }
}

/// A loaded checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// `config.json`.
    pub config: CheckpointConfig,
    /// Every stage's state, in order.
    pub stages: Vec<StageState>,
}

/// One tensor of a stage file: its name (without the `param.` / `adam_m.` / `adam_v.`
/// prefix), spec and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// e.g. `embedding.wte`, `blocks.3.qkv_w`, `head.lm_head`.
    pub name: String,
    /// Length, init, decay.
    pub spec: TensorSpec,
    /// Shape: matrices are `[out, in]`, row-major.
    pub shape: Vec<usize>,
}

/// The tensors of stage `spec` of `cfg`, in the order of the stage's flat buffers. Block
/// tensors carry the global layer index, so names do not depend on the cut.
pub fn stage_tensors(cfg: &ModelConfig, spec: &StageSpec) -> Vec<NamedTensor> {
    let d = cfg.d_model;
    let shape = |t: &TensorSpec| match t.name {
        "wte" | "wpe" | "lm_head" | "qkv_w" | "attproj_w" | "fc_w" => vec![t.len / d, d],
        "fcproj_w" => vec![d, cfg.ffn_hidden],
        _ => vec![t.len],
    };
    let mut v = Vec::new();
    let mut push = |prefix: String, list: Vec<TensorSpec>| {
        for t in list {
            v.push(NamedTensor {
                name: format!("{prefix}.{}", t.name),
                shape: shape(&t),
                spec: t,
            });
        }
    };
    if spec.embedding {
        push("embedding".into(), embedding_tensors(cfg));
    }
    for l in spec.blocks.clone() {
        push(format!("blocks.{l}"), block_tensors(cfg));
    }
    if spec.head {
        push("head".into(), head_tensors(cfg));
    }
    v
}

const KINDS: [&str; 3] = ["param", "adam_m", "adam_v"];

fn stage_metadata(
    cfg: &ModelConfig,
    spec: &StageSpec,
    steps_done: usize,
) -> Vec<(&'static str, String)> {
    vec![
        ("format", STAGE_FORMAT.into()),
        ("version", VERSION.to_string()),
        ("model", cfg.name.clone()),
        ("stage", spec.index.to_string()),
        ("n_stages", cfg.n_stages.to_string()),
        ("steps_done", steps_done.to_string()),
    ]
}

fn crc_of<'a>(mut named: Vec<(&'a str, &'a [u8])>) -> String {
    named.sort_by(|a, b| a.0.cmp(b.0));
    let crc = named
        .iter()
        .fold(0u32, |c, (_, data)| crc32c::crc32c_append(c, data));
    format!("{crc:08x}")
}

/// Writes stage `spec`'s state as one safetensors file at `path` (atomically). `cfg` must
/// have `n_stages` set to the plan's. This is all a node serving the stage needs to write
/// its part of a checkpoint.
pub fn write_stage_file(
    path: &Path,
    cfg: &ModelConfig,
    spec: &StageSpec,
    st: &StageState,
    steps_done: usize,
) -> Result<(), ModelError> {
    let n: usize = stage_tensors(cfg, spec).iter().map(|t| t.spec.len).sum();
    st.check(spec.index, n)?;
    let bufs = [&st.params, &st.m, &st.v].map(|b| f32s_to_bytes(b));
    let parts = StateParts {
        index: st.index,
        step: st.step,
        params: &bufs[0],
        m: &bufs[1],
        v: &bufs[2],
    };
    write_stage_parts(path, cfg, spec, &parts, steps_done)
}

/// [`write_stage_file`] of a state as it travels ([`StateParts`], borrowed
/// from a received `export_state`): its bytes go to the file as they are,
/// with no copy of the state in between (a swarm's checkpoint writer runs
/// beside training and must not take its memory bandwidth).
pub fn write_stage_parts(
    path: &Path,
    cfg: &ModelConfig,
    spec: &StageSpec,
    st: &StateParts,
    steps_done: usize,
) -> Result<(), ModelError> {
    let tensors = stage_tensors(cfg, spec);
    let n: usize = tensors.iter().map(|t| t.spec.len).sum();
    if st.index != spec.index || [st.params, st.m, st.v].iter().any(|b| b.len() != 4 * n) {
        return Err(ModelError::BadState(format!(
            "state of stage {} with {}/{}/{} bytes of params/m/v for stage {} with {n} params",
            st.index,
            st.params.len(),
            st.m.len(),
            st.v.len(),
            spec.index
        )));
    }
    let mut named: Vec<(String, Vec<usize>, &[u8])> = Vec::new();
    for (kind, buf) in KINDS.iter().zip([st.params, st.m, st.v]) {
        let mut off = 0;
        for t in &tensors {
            let len = 4 * t.spec.len;
            named.push((
                format!("{kind}.{}", t.name),
                t.shape.clone(),
                &buf[off..off + len],
            ));
            off += len;
        }
    }
    let mut meta: HashMap<String, String> = stage_metadata(cfg, spec, steps_done)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    meta.insert("adam_step".into(), st.step.to_string());
    meta.insert(
        "crc32c".into(),
        crc_of(named.iter().map(|(k, _, d)| (k.as_str(), *d)).collect()),
    );
    // The file is what `safetensors::serialize` gives (tensors in name
    // order, as all are F32; the header padded to 8 bytes), with the
    // metadata sorted, written from the borrowed bytes: no serialized copy
    // of the state in memory.
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut infos = Vec::with_capacity(named.len());
    let mut offset = 0;
    for (k, shape, d) in &named {
        if shape.iter().product::<usize>() * 4 != d.len() {
            return Err(err(
                path,
                format!("tensor {k} of shape {shape:?} has {} bytes", d.len()),
            ));
        }
        let info = TensorInfo {
            dtype: Dtype::F32,
            shape: shape.clone(),
            data_offsets: (offset, offset + d.len()),
        };
        infos.push((k.clone(), info));
        offset += d.len();
    }
    let header = Metadata::new(Some(meta), infos).map_err(|e| err(path, e))?;
    let mut json = serde_json::to_vec(&header).map_err(|e| err(path, e))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&json);
    sort_metadata(&mut head);
    let mut tmp = temp_file_beside(path)?;
    std::iter::once(&head[..])
        .chain(named.iter().map(|(_, _, d)| *d))
        .try_for_each(|b| tmp.write_all(b))
        .and_then(|_| tmp.as_file().sync_all())
        .map_err(|e| err(path, format!("cannot write: {e}")))?;
    persist(tmp, path)
}

/// Rewrites the header's `__metadata__` object with its keys sorted (the crate writes them
/// in hash order, which changes from one process to the next), so that the same state
/// always gives the same bytes: stage files can then be compared by hash. The rewrite has
/// the same length; if the header does not start as expected it is left alone.
fn sort_metadata(buf: &mut [u8]) {
    const KEY: &[u8] = b"{\"__metadata__\":";
    let start = 8 + KEY.len();
    if buf.len() < start || &buf[8..start] != KEY {
        return;
    }
    let mut it = serde_json::Deserializer::from_slice(&buf[start..])
        .into_iter::<std::collections::BTreeMap<String, String>>();
    let Some(Ok(map)) = it.next() else { return };
    let end = start + it.byte_offset();
    if let Ok(sorted) = serde_json::to_vec(&map) {
        if sorted.len() == end - start {
            buf[start..end].copy_from_slice(&sorted);
        }
    }
}

/// Reads stage `spec`'s file at `path`, checking everything against what is expected:
/// format, version, model, stage, plan, steps done, every tensor's name, type and shape,
/// and the checksum. Any mismatch, truncation or corruption is [`ModelError::Checkpoint`]
/// naming the file.
pub fn read_stage_file(
    path: &Path,
    cfg: &ModelConfig,
    spec: &StageSpec,
    steps_done: usize,
) -> Result<StageState, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| err(path, format!("cannot read: {e}")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(path, format!("not a valid safetensors file ({e})")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| err(path, format!("not a valid safetensors file ({e})")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).map(String::as_str).unwrap_or("(missing)");
    for (k, want) in stage_metadata(cfg, spec, steps_done) {
        if get(k) != want {
            return Err(err(
                path,
                format!("metadata {k} is {:?}, expected {want:?}", get(k)),
            ));
        }
    }
    let step: u64 = get("adam_step")
        .parse()
        .map_err(|_| err(path, format!("metadata adam_step {:?}", get("adam_step"))))?;
    let tensors = stage_tensors(cfg, spec);
    if st.len() != KINDS.len() * tensors.len() {
        return Err(err(
            path,
            format!(
                "{} tensors, expected {}",
                st.len(),
                KINDS.len() * tensors.len()
            ),
        ));
    }
    let names: Vec<String> = KINDS
        .iter()
        .flat_map(|k| tensors.iter().map(move |t| format!("{k}.{}", t.name)))
        .collect();
    let mut views = Vec::with_capacity(names.len());
    for (name, t) in names.iter().zip(tensors.iter().cycle()) {
        let v = st
            .tensor(name)
            .map_err(|_| err(path, format!("tensor {name} is missing")))?;
        if v.dtype() != Dtype::F32 || v.shape() != t.shape.as_slice() {
            return Err(err(
                path,
                format!(
                    "tensor {name} is {:?} {:?}, expected F32 {:?}",
                    v.dtype(),
                    v.shape(),
                    t.shape
                ),
            ));
        }
        views.push(v);
    }
    let crc = crc_of(
        names
            .iter()
            .map(String::as_str)
            .zip(views.iter().map(|v| v.data()))
            .collect(),
    );
    if get("crc32c") != crc {
        return Err(err(
            path,
            format!(
                "checksum mismatch (crc32c {} recorded, {crc} computed): the file is corrupted",
                get("crc32c")
            ),
        ));
    }
    // One flat buffer per kind (param, adam_m, adam_v), tensors in buffer order.
    let flat = |kind: usize| -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::new();
        for v in &views[kind * tensors.len()..(kind + 1) * tensors.len()] {
            out.extend(bytes_to_f32s(v.data()).map_err(|e| err(path, e))?);
        }
        Ok(out)
    };
    let (params, m, v) = (flat(0)?, flat(1)?, flat(2)?);
    Ok(StageState {
        index: spec.index,
        step,
        params,
        m,
        v,
    })
}

/// Saves a checkpoint in `dir` (created if needed): every stage file, then `config.json`.
pub fn save(
    dir: &Path,
    config: &CheckpointConfig,
    stages: &[StageState],
) -> Result<(), ModelError> {
    save_with(dir, config, stages.len(), |path, cfg, spec, i| {
        write_stage_file(path, cfg, spec, &stages[i], config.steps_done)
    })
}

/// [`save`] of states as they travel ([`write_stage_parts`]).
pub fn save_parts(
    dir: &Path,
    config: &CheckpointConfig,
    stages: &[StateParts],
) -> Result<(), ModelError> {
    save_with(dir, config, stages.len(), |path, cfg, spec, i| {
        write_stage_parts(path, cfg, spec, &stages[i], config.steps_done)
    })
}

/// Checks that `count` states fit `config`'s plan, writes stage `i`'s file
/// with `write(path, cfg, spec, i)`, then `config.json`.
fn save_with(
    dir: &Path,
    config: &CheckpointConfig,
    count: usize,
    write: impl Fn(&Path, &ModelConfig, &StageSpec, usize) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| err(dir, format!("cannot create: {e}")))?;
    let cfg = config.model_config()?;
    let plan = StagePlan::new(&cfg, cfg.n_stages)?;
    if count != plan.len() || config.stages.len() != plan.len() {
        return Err(err(
            dir,
            format!("{count} stage states for {} stages", plan.len()),
        ));
    }
    for (i, (spec, entry)) in plan.stages.iter().zip(&config.stages).enumerate() {
        write(&dir.join(&entry.file), &cfg, spec, i)?;
    }
    let mut json = serde_json::to_vec_pretty(config).map_err(|e| err(dir, e))?;
    json.push(b'\n');
    write_atomically(&dir.join(CONFIG_FILE), &json)
}

/// Reads `dir/config.json` alone (what it says, without the weights); `dir`
/// as [`resolve`] takes it.
pub fn read_config(dir: &Path) -> Result<CheckpointConfig, ModelError> {
    let dir = &resolve(dir)?;
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|e| err(&path, format!("cannot read: {e}")))?;
    let c: CheckpointConfig = serde_json::from_slice(&text)
        .map_err(|e| err(&path, format!("not a valid checkpoint config ({e})")))?;
    if c.format != FORMAT || c.version != VERSION {
        return Err(err(
            &path,
            format!(
                "format {:?} version {}, expected {FORMAT:?} version {VERSION}",
                c.format, c.version
            ),
        ));
    }
    Ok(c)
}

/// Loads the checkpoint in `dir` (as [`resolve`] takes it): `config.json`,
/// then every stage file, each checked.
pub fn load(dir: &Path) -> Result<Checkpoint, ModelError> {
    let dir = &resolve(dir)?;
    let config = read_config(dir)?;
    let path = dir.join(CONFIG_FILE);
    let cfg = config.model_config().map_err(|e| err(&path, e))?;
    let plan = StagePlan::new(&cfg, cfg.n_stages).map_err(|e| err(&path, e))?;
    if config.stages.len() != plan.len() {
        return Err(err(
            &path,
            format!(
                "{} stages listed, n_stages is {}",
                config.stages.len(),
                plan.len()
            ),
        ));
    }
    let mut stages = Vec::with_capacity(plan.len());
    for (spec, entry) in plan.stages.iter().zip(&config.stages) {
        let file = stage_path(dir, &entry.file)?;
        stages.push(read_stage_file(&file, &cfg, spec, config.steps_done)?);
    }
    Ok(Checkpoint { config, stages })
}

/// A stage file listed in `config.json`: a plain file name inside `dir`, nothing else.
fn stage_path(dir: &Path, file: &str) -> Result<PathBuf, ModelError> {
    let p = Path::new(file);
    if p.components().count() != 1 || p.file_name().is_none() {
        return Err(err(
            &dir.join(CONFIG_FILE),
            format!("stage file {file:?} is not a file name"),
        ));
    }
    Ok(dir.join(p))
}

/// Writes `bytes` to `path` through a temporary file in the same directory that is flushed
/// to disk and renamed over `path`, then flushes the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let mut tmp = temp_file_beside(path)?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().sync_all())
        .map_err(|e| err(path, format!("cannot write: {e}")))?;
    persist(tmp, path)
}

/// A temporary file in `path`'s directory (an ordinary file: the umask
/// applies, not tempfile's private 0600), to be renamed over `path`.
fn temp_file_beside(path: &Path) -> Result<tempfile::NamedTempFile, ModelError> {
    let mut b = tempfile::Builder::new();
    b.prefix(".tmp-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o666));
    }
    b.tempfile_in(parent_of(path))
        .map_err(|e| err(path, format!("cannot create a temporary file: {e}")))
}

/// Renames the written and flushed `tmp` over `path`, then flushes the
/// directory.
fn persist(tmp: tempfile::NamedTempFile, path: &Path) -> Result<(), ModelError> {
    tmp.persist(path)
        .map_err(|e| err(path, format!("cannot rename into place: {}", e.error)))?;
    if let Ok(d) = std::fs::File::open(parent_of(path)) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}
