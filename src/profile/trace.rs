//! `trace.json` in the Chrome trace event format (the JSON object form, opened by Perfetto
//! and chrome://tracing): one process with three tracks — compute (every op of the profiled
//! steps inside its step), I/O (batches staged, checkpoints written, tier transfers) and
//! communication (collectives; under `mpirun`, rank 0's, then one track per other rank:
//! `communication, rank r`) — plus counter tracks: the plan's bytes by category at each op
//! in host RAM, the disk tier's live bytes (`--offload`), and the measured resident memory
//! above the process baseline. Each read and write of the disk tier during a step is a
//! complete event on the I/O track with its bytes, direction and GB/s.

use super::record::{Profile, Track};
use super::timeline::MemoryTimeline;
use crate::run_dir::PlanJson;
use serde_json::{Map, Value, json};

const PID: u32 = 1;

/// The counter track of the disk tier's live bytes.
pub const DISK_COUNTER: &str = "plan: disk tier (offload file) live bytes";

fn tid(track: Track) -> u32 {
    match track {
        Track::Compute => 1,
        Track::Io => 2,
        Track::Communication => 3,
    }
}

/// The track of another rank's collectives (sent to rank 0, which writes the trace).
fn rank_tid(rank: u32) -> u32 {
    100 + rank
}

fn track_name(track: Track) -> &'static str {
    match track {
        Track::Compute => "compute",
        Track::Io => "io",
        Track::Communication => "communication",
    }
}

/// Builds the trace of every profiled step.
pub fn chrome_trace(plan: &PlanJson, profile: &Profile, timeline: &MemoryTimeline) -> Value {
    let mut ev: Vec<Value> = Vec::new();
    ev.push(
        json!({"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
                   "args": {"name": format!("memwall {}", plan.model_name)}}),
    );
    for track in [Track::Compute, Track::Io, Track::Communication] {
        ev.push(
            json!({"ph": "M", "pid": PID, "tid": tid(track), "name": "thread_name",
                       "args": {"name": track_name(track)}}),
        );
        ev.push(
            json!({"ph": "M", "pid": PID, "tid": tid(track), "name": "thread_sort_index",
                       "args": {"sort_index": tid(track)}}),
        );
    }
    // The other ranks' communication tracks, one per rank below rank 0's.
    let mut ranks: Vec<u32> = profile
        .steps
        .iter()
        .flat_map(|s| s.spans.iter().filter_map(|sp| sp.rank))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        ev.push(
            json!({"ph": "M", "pid": PID, "tid": rank_tid(r), "name": "thread_name",
                       "args": {"name": format!("communication, rank {r}")}}),
        );
        ev.push(
            json!({"ph": "M", "pid": PID, "tid": rank_tid(r), "name": "thread_sort_index",
                       "args": {"sort_index": rank_tid(r)}}),
        );
    }
    let cats = &timeline.categories;
    for step in &profile.steps {
        ev.push(json!({"ph": "X", "pid": PID, "tid": tid(Track::Compute),
                       "name": format!("step {}", step.step), "cat": "step",
                       "ts": step.start_us, "dur": step.end_us - step.start_us}));
        let mut last_live: Option<&[u64]> = None;
        let mut last_disk: Option<u64> = None;
        for s in &step.ops {
            let op = s.op as usize;
            let Some(info) = plan.schedule.get(op) else {
                continue;
            };
            let dur = s.end_us - s.start_us;
            let mut args = json!({"op": op, "phase": info.phase, "flops": info.flops});
            if info.flops > 0 && dur > 0.0 {
                args["gflops_per_s"] = json!(info.flops as f64 / dur / 1e3);
            }
            ev.push(json!({"ph": "X", "pid": PID, "tid": tid(Track::Compute),
                           "name": info.name, "cat": info.phase,
                           "ts": s.start_us, "dur": dur, "args": args}));
            let live = &timeline.live[op];
            if last_live != Some(live.as_slice()) {
                let args: Map<String, Value> = cats
                    .iter()
                    .zip(live)
                    .map(|(c, b)| (c.name().to_string(), json!(b)))
                    .collect();
                ev.push(
                    json!({"ph": "C", "pid": PID, "name": "plan: host RAM by category",
                               "ts": s.start_us, "args": args}),
                );
                last_live = Some(live);
            }
            if let Some(&d) = timeline.disk.get(op)
                && last_disk != Some(d)
            {
                ev.push(json!({"ph": "C", "pid": PID, "name": DISK_COUNTER,
                               "ts": s.start_us, "args": {"bytes": d}}));
                last_disk = Some(d);
            }
            if s.rss > 0 {
                ev.push(
                    json!({"ph": "C", "pid": PID, "name": "measured: RSS above baseline",
                               "ts": s.end_us,
                               "args": {"bytes": s.rss.saturating_sub(profile.baseline_rss)}}),
                );
            }
        }
        for sp in &step.spans {
            let dur = sp.end_us - sp.start_us;
            let mut args = json!({});
            if let Some(b) = sp.bytes {
                args["bytes"] = json!(b);
                if dur > 0.0 {
                    args["gb_per_s"] = json!(b as f64 / dur / 1e3);
                }
            }
            if let Some(d) = sp.direction {
                args["direction"] = json!(d.name());
            }
            let tid = sp.rank.map_or(tid(sp.track), rank_tid);
            ev.push(json!({"ph": "X", "pid": PID, "tid": tid,
                           "name": sp.name, "cat": track_name(sp.track),
                           "ts": sp.start_us, "dur": dur, "args": args}));
        }
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "model": plan.model_name,
            "precision": plan.precision,
            "recompute": plan.config_str("recompute"),
            "plan_total_bytes": plan.total_bytes,
            "disk_tier_bytes": plan.by_tier.get("nvme").and_then(Value::as_u64).unwrap_or(0),
            "io_read_bytes_per_step": plan.io_read_bytes_per_step,
            "io_write_bytes_per_step": plan.io_write_bytes_per_step,
            "baseline_rss_bytes": profile.baseline_rss,
            "profiled_steps": profile.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        }
    })
}

/// Checks that `v` is Chrome trace JSON as the viewers read it: an object with a
/// `traceEvents` array whose events carry the fields their phase requires. Returns the number
/// of events; the error names the first bad event.
pub fn validate(v: &Value) -> Result<usize, String> {
    let events = v
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or("no 'traceEvents' array")?;
    for (i, e) in events.iter().enumerate() {
        let bad = |what: &str| Err(format!("event {i} ({e}): {what}"));
        let Some(ph) = e.get("ph").and_then(Value::as_str) else {
            return bad("no 'ph'");
        };
        if e.get("name").and_then(Value::as_str).is_none() {
            return bad("no 'name'");
        }
        if e.get("pid").and_then(Value::as_u64).is_none() {
            return bad("no integer 'pid'");
        }
        let ts_ok = e
            .get("ts")
            .and_then(Value::as_f64)
            .is_some_and(|t| t >= 0.0);
        match ph {
            "M" => {
                if e.get("args").and_then(Value::as_object).is_none() {
                    return bad("metadata without 'args'");
                }
            }
            "X" => {
                if !ts_ok || e.get("tid").and_then(Value::as_u64).is_none() {
                    return bad("complete event without 'ts' or 'tid'");
                }
                if !e
                    .get("dur")
                    .and_then(Value::as_f64)
                    .is_some_and(|d| d >= 0.0)
                {
                    return bad("complete event without a non-negative 'dur'");
                }
            }
            "C" => {
                let Some(args) = e.get("args").and_then(Value::as_object) else {
                    return bad("counter without 'args'");
                };
                if !ts_ok || args.values().any(|a| !a.is_number()) {
                    return bad("counter needs 'ts' and numeric 'args'");
                }
            }
            other => return bad(&format!("phase '{other}' is not one memwall writes")),
        }
    }
    Ok(events.len())
}
