//! `gwtf node --save DIR`: a data holder writes each complete checkpoint
//! round the runtime hands it (`NodeEvent::Checkpoint`) on a thread of its
//! own (at the lowest priority: it runs on what training leaves), so that
//! training never waits for the disk or the encoding, one at a time: a round
//! that comes while one is being written waits, and a newer one replaces it
//! (`checkpoint_skipped`), so the newest round is always written. Prints
//! `checkpoint` (or `checkpoint_failed`) when one is done.
use gwtf::model::dataset::DataDescription;
use gwtf::protocol::NodeId;
use gwtf::swarm::event_log::LogEvent;
use gwtf::swarm::model_checkpoint::{self, Manifest};
use gwtf::swarm::model_trainer::ModelRun;
use gwtf::swarm::saves::SavedState;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::thread::JoinHandle;
use std::time::Instant;

/// What a write came to: (iteration, result, milliseconds, bytes).
type Written = (u32, Result<(PathBuf, Manifest), String>, f64, u64);

pub struct Saver {
    dir: PathBuf,
    keep: usize,
    run: ModelRun,
    data: DataDescription,
    me: NodeId,
    writing: Option<(JoinHandle<()>, Receiver<Written>)>,
    /// The newest round that came while one was being written.
    queued: Option<(u32, Vec<SavedState>)>,
    /// A test aid: the writer waits this long with every file written,
    /// before the checkpoint takes its name.
    pub pause: std::time::Duration,
    /// The iteration of the last checkpoint written.
    pub last: Option<u32>,
}

impl Saver {
    pub fn new(
        dir: PathBuf,
        keep: usize,
        run: ModelRun,
        data: DataDescription,
        me: NodeId,
    ) -> Saver {
        Saver {
            dir,
            keep,
            run,
            data,
            me,
            writing: None,
            queued: None,
            last: None,
            pause: std::time::Duration::ZERO,
        }
    }

    /// A complete round of `iteration`: written on a thread, or, while one
    /// is being written, next (the event to print says which round waiting
    /// it replaced).
    pub fn start(&mut self, iteration: u32, states: Vec<SavedState>) -> Option<LogEvent> {
        if self.writing.is_some() {
            let old = self.queued.replace((iteration, states));
            return old.map(|(it, _)| LogEvent::CheckpointSkipped {
                node: self.me.into(),
                iteration: it.into(),
                why: format!("a newer round ({iteration}) came while another was being written"),
            });
        }
        let (tx, rx) = channel();
        let (dir, keep, run, data, me, pause) = (
            self.dir.clone(),
            self.keep,
            self.run.clone(),
            self.data.clone(),
            self.me,
            self.pause,
        );
        let h = std::thread::spawn(move || {
            gwtf::swarm::background::lower_priority();
            let t = Instant::now();
            let bytes: u64 = states.iter().map(|s| s.state.len() as u64).sum();
            let r =
                model_checkpoint::write(&dir, &run, &data, me, iteration, &states, keep, || {
                    std::thread::sleep(pause)
                });
            let _ = tx.send((iteration, r, t.elapsed().as_secs_f64() * 1e3, bytes));
        });
        self.writing = Some((h, rx));
        None
    }

    /// The event of the write that ended, if one did (`wait`: until it
    /// does).
    pub fn poll(&mut self, wait: bool) -> Option<LogEvent> {
        let (_, rx) = self.writing.as_ref()?;
        let got = if wait {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        let done = match got {
            Some(d) => d,
            // The writer died without a word (it panicked).
            None if wait || self.writing.as_ref().is_some_and(|(h, _)| h.is_finished()) => {
                self.writing = None;
                if let Some((it, states)) = self.queued.take() {
                    self.start(it, states);
                }
                return Some(LogEvent::CheckpointFailed {
                    node: self.me.into(),
                    iteration: None,
                    why: "the writer thread died".into(),
                });
            }
            None => return None,
        };
        if let Some((h, _)) = self.writing.take() {
            let _ = h.join();
        }
        if let Some((it, states)) = self.queued.take() {
            self.start(it, states);
        }
        let (iteration, r, ms, bytes) = done;
        Some(match r {
            Ok((path, m)) => {
                self.last = Some(iteration);
                LogEvent::Checkpoint {
                    node: self.me.into(),
                    iteration: iteration.into(),
                    dir: path.display().to_string(),
                    ms,
                    bytes,
                    stages: m.stages,
                }
            }
            Err(why) => LogEvent::CheckpointFailed {
                node: self.me.into(),
                iteration: Some(iteration.into()),
                why,
            },
        })
    }
}
