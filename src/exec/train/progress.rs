//! How a training run reports progress: the [`Progress`] trait, a terminal implementation
//! ([`ConsoleProgress`]) and a silent one ([`NoProgress`]).

use crate::util::bytes::fmt_bytes;

/// How a run reports progress.
pub trait Progress {
    fn start(&mut self, first_step: u64, total: u64);
    fn step(&mut self, step: u64, loss: f32, tokens_per_s: f64, rss: Option<u64>);
    fn message(&mut self, msg: &str);
    fn finish(&mut self);
}

/// Terminal progress: a bar on a terminal, periodic lines otherwise (logs, CI).
pub struct ConsoleProgress {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    log_every: u64,
}

impl ConsoleProgress {
    pub fn new(log_every: u64) -> ConsoleProgress {
        ConsoleProgress {
            bar: None,
            total: 0,
            log_every: log_every.max(1),
        }
    }
}

impl Progress for ConsoleProgress {
    fn start(&mut self, first_step: u64, total: u64) {
        self.total = total;
        let bar = indicatif::ProgressBar::new(total);
        if bar.is_hidden() {
            return;
        }
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} eta {eta}")
                .expect("valid template"),
        );
        bar.set_position(first_step);
        self.bar = Some(bar);
    }

    fn step(&mut self, step: u64, loss: f32, tps: f64, rss: Option<u64>) {
        let mem = rss.map(fmt_bytes).unwrap_or_else(|| "?".into());
        let msg = format!("loss {loss:.4} | {tps:.0} tok/s | rss {mem}");
        match &self.bar {
            Some(bar) => {
                bar.set_position(step);
                bar.set_message(msg);
            }
            None => {
                if step.is_multiple_of(self.log_every) || step == self.total || step == 1 {
                    eprintln!("step {step:>6}/{} | {msg}", self.total);
                }
            }
        }
    }

    fn message(&mut self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}

/// Silent progress (tests, benchmarks).
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&mut self, _: u64, _: u64) {}
    fn step(&mut self, _: u64, _: f32, _: f64, _: Option<u64>) {}
    fn message(&mut self, _: &str) {}
    fn finish(&mut self) {}
}
