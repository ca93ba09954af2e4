//! Checkpoints of a swarm of the built-in model (`gwtf node --save DIR`):
//! a data holder's complete checkpoint round ([`super::saves`], every
//! stage's state of one iteration) written as docs/CHECKPOINT.md's
//! directory, so that `gwtf sample --checkpoint`, `gwtf train --resume`
//! and `gwtf node --resume` read it.
//!
//! Complete or absent: each checkpoint is written into a temporary
//! directory inside `DIR` (every stage file, `config.json`, then
//! `manifest.json`, each flushed), which is then renamed to
//! `DIR/iteration-NNNNNN` in one step; `DIR/LATEST` (written atomically
//! after) names the newest. A writer killed midway leaves a `.tmp-`
//! directory, never a checkpoint, and the next write removes it.
use super::model_trainer::{stage_parts, ModelRun};
use super::saves::SavedState;
use crate::model::checkpoint::{self, CheckpointConfig};
use crate::model::dataset::DataDescription;
use crate::model::train::Progress;
use crate::model::StateParts;
use crate::protocol::{NodeId, Stage};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The manifest's `format`.
pub const MANIFEST_FORMAT: &str = "gwtf-swarm-checkpoint";
/// The manifest's file name inside a checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";

/// `manifest.json`: where each protocol stage's state came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The iteration whose update every stage's state includes last.
    pub iteration: u32,
    /// The data holder that wrote it.
    pub written_by: NodeId,
    pub stages: Vec<ManifestStage>,
}

/// One protocol stage of a swarm checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestStage {
    /// Protocol stage (0: the data holders').
    pub stage: Stage,
    /// The node whose trainer exported it.
    pub from: NodeId,
    /// Its model stages' files.
    pub files: Vec<String>,
    /// The weights digest of the state, as the stage's replicas printed it
    /// (`applied` events) for this iteration.
    pub weights_sha256: String,
}

/// Writes the checkpoint of `states` (a complete round of `iteration`,
/// written by holder `me`) under `dir`, keeping the newest `keep` (at
/// least 1). Returns its directory and manifest. `before_publish` runs
/// once every file is written, before the checkpoint takes its name (a
/// test's moment to kill the writer).
#[allow(clippy::too_many_arguments)]
pub fn write(
    dir: &Path,
    run: &ModelRun,
    data: &DataDescription,
    me: NodeId,
    iteration: u32,
    states: &[SavedState],
    keep: usize,
    before_publish: impl FnOnce(),
) -> Result<(PathBuf, Manifest), String> {
    let at = |e: &dyn std::fmt::Display| format!("{}: {e}", dir.display());
    let mut model: Vec<Option<StateParts>> = vec![None; run.stages];
    let mut stages = Vec::new();
    for s in states {
        let (parts, digest) = stage_parts(run, s.stage, &s.state)
            .map_err(|e| format!("the state of stage {} from {:x}: {e}", s.stage, s.from))?;
        let mut files = Vec::new();
        for st in parts {
            files.push(checkpoint::stage_file_name(st.index));
            *model
                .get_mut(st.index)
                .ok_or("a model stage out of the plan")? = Some(st);
        }
        stages.push(ManifestStage {
            stage: s.stage,
            from: s.from,
            files,
            weights_sha256: digest.iter().map(|b| format!("{b:02x}")).collect(),
        });
    }
    let all: Vec<StateParts> = (model.into_iter().enumerate())
        .map(|(i, s)| s.ok_or(format!("no state of model stage {i}")))
        .collect::<Result<_, _>>()?;
    let progress = Progress {
        steps_done: iteration as usize + 1,
        data_rng_state: 0,
    };
    let config = CheckpointConfig::new(&run.cfg, &run.opts, data, &progress).map_err(|e| at(&e))?;
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: 1,
        iteration,
        written_by: me,
        stages,
    };
    std::fs::create_dir_all(dir).map_err(|e| at(&e))?;
    remove_leftovers(dir);
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempdir_in(dir)
        .map_err(|e| at(&e))?;
    checkpoint::save_parts(tmp.path(), &config, &all).map_err(|e| e.to_string())?;
    let mut json = serde_json::to_vec_pretty(&manifest).map_err(|e| at(&e))?;
    json.push(b'\n');
    checkpoint::write_atomically(&tmp.path().join(MANIFEST_FILE), &json)
        .map_err(|e| e.to_string())?;
    before_publish();
    let name = format!("iteration-{iteration:06}");
    let path = dir.join(&name);
    if path.exists() {
        // The same iteration again (a resumed run): the old one goes aside
        // first, then away once the new one is in place.
        let old = dir.join(format!(".tmp-old-{name}"));
        std::fs::rename(&path, &old).map_err(|e| at(&e))?;
        std::fs::rename(tmp.keep(), &path).map_err(|e| at(&e))?;
        let _ = std::fs::remove_dir_all(old);
    } else {
        std::fs::rename(tmp.keep(), &path).map_err(|e| at(&e))?;
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    checkpoint::write_atomically(
        &dir.join(checkpoint::LATEST_FILE),
        format!("{name}\n").as_bytes(),
    )
    .map_err(|e| e.to_string())?;
    prune(dir, keep.max(1), &name);
    Ok((path, manifest))
}

/// Reads `manifest.json` of the swarm checkpoint in `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, String> {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let m: Manifest = serde_json::from_slice(&text)
        .map_err(|e| format!("{}: not a swarm checkpoint manifest ({e})", path.display()))?;
    if m.format != MANIFEST_FORMAT || m.version != 1 {
        return Err(format!(
            "{}: format {:?} version {}",
            path.display(),
            m.format,
            m.version
        ));
    }
    Ok(m)
}

/// Temporary directories a killed writer left.
fn remove_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") && e.path().is_dir() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Removes all but the newest `keep` checkpoints (never `newest`).
fn prune(dir: &Path, keep: usize, newest: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("iteration-") && n.as_str() != newest)
        .collect();
    names.sort();
    let excess = (names.len() + 1).saturating_sub(keep);
    for n in names.into_iter().take(excess) {
        let _ = std::fs::remove_dir_all(dir.join(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dataset::Dataset;
    use crate::model::preset;
    use crate::swarm::model_trainer::ModelTrainer;
    use std::sync::Arc;

    fn round(run: &ModelRun) -> (Vec<SavedState>, DataDescription) {
        let data = Dataset::synthetic(1, run.opts.corpus_bytes, run.opts.seq);
        let states = (0..=2u16)
            .map(|stage| {
                let docs = if stage == 0 {
                    data.train.clone()
                } else {
                    Vec::new()
                };
                let t = ModelTrainer::new(run.clone(), stage, docs).unwrap();
                SavedState {
                    stage,
                    from: 10 + stage as NodeId,
                    state: Arc::new(t.export_bytes().unwrap()),
                }
            })
            .collect();
        (states, data.description)
    }

    /// Checkpoints are named by iteration, the newest `keep` stay, LATEST
    /// names the newest, a killed writer's leftovers go at the next write,
    /// and the same iteration written again replaces the old one.
    #[test]
    fn checkpoints_are_named_pruned_and_leftovers_removed() {
        let run = ModelRun::new(preset("llama-tiny").unwrap(), 4, 1, 10).unwrap();
        let (states, data) = round(&run);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join(".tmp-killed")).unwrap();
        for it in [1, 3, 5] {
            let (path, m) = write(d, &run, &data, 1, it, &states, 2, || {}).unwrap();
            assert_eq!(path, d.join(format!("iteration-{it:06}")));
            assert_eq!((m.iteration, m.stages.len()), (it, 3));
        }
        let mut names: Vec<String> = (std::fs::read_dir(d).unwrap().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["LATEST", "iteration-000003", "iteration-000005"]);
        let ck = checkpoint::load(d).unwrap();
        assert_eq!(ck.config.steps_done, 6);
        write(d, &run, &data, 1, 5, &states, 2, || {}).unwrap();
        assert_eq!(checkpoint::load(d).unwrap().config.steps_done, 6);
        let m = read_manifest(&d.join("iteration-000005")).unwrap();
        assert_eq!(
            m.stages[0].files,
            ["stage-0.safetensors", "stage-3.safetensors"]
        );
    }

    /// A round missing a stage, or with a state that is not its stage's,
    /// writes nothing.
    #[test]
    fn an_incomplete_or_bad_round_writes_nothing() {
        let run = ModelRun::new(preset("llama-tiny").unwrap(), 4, 1, 10).unwrap();
        let (mut states, data) = round(&run);
        let dir = tempfile::tempdir().unwrap();
        let e = write(dir.path(), &run, &data, 1, 1, &states[..2], 2, || {}).unwrap_err();
        assert!(e.contains("model stage 2"), "{e}");
        states[1].state = Arc::new(vec![1, 2, 3]);
        assert!(write(dir.path(), &run, &data, 1, 1, &states, 2, || {}).is_err());
        assert_eq!(
            std::fs::read_dir(dir.path())
                .map(|r| r.count())
                .unwrap_or(0),
            0
        );
    }
}
