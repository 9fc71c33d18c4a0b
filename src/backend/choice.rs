//! Which backend runs a plan: `--device KIND[:N]`, chosen once where the user's request is
//! resolved and carried in the options as a [`DeviceId`] (a [`DeviceKind`] and the device's
//! number among those of its kind); everything after opens it ([`DeviceId::open`], which can
//! fail: a GPU may be missing, busy or out of memory) for its [`Backend`]. A second backend
//! is one more arm of [`DeviceKind::open`].
//!
//! The flag's syntax is `KIND` or `KIND:N`: `cpu` is `cpu:0`, and what is recorded prints
//! device 0 as its bare kind, so a record written before devices had numbers reads the same.
//!
//! Planning needs only a kind's [`Sizing`] ([`DeviceId::sizing`]), which every build has and
//! which opens nothing: `memwall plan --device cuda` answers on a machine without a GPU, or
//! with a build without the `cuda` feature. Running needs the backend ([`DeviceId::open`]).

use super::Backend;
use super::cpu::Cpu;
use super::cuda::CudaSizing;
use crate::ir::Sizing;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// A backend memwall can run on (the `KIND` of `--device KIND[:N]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// This machine's cores (`backend::cpu`).
    #[default]
    Cpu,
    /// An NVIDIA GPU (`backend::cuda`, cargo feature `cuda`).
    Cuda,
}

impl DeviceKind {
    /// Opens device `index` of this kind (GPUs are numbered from 0; the CPU, all of this
    /// machine's cores, is the one device 0): the backend that plans and runs for it, opened
    /// once per process. Fails naming the device when there is no such one.
    pub fn open(self, index: usize) -> Result<&'static dyn Backend> {
        self.check_index(index)?;
        match self {
            DeviceKind::Cpu => Ok(&Cpu),
            DeviceKind::Cuda => super::cuda::open(index),
        }
    }

    /// What the planner asks of this kind's backend ([`Sizing`]): pure, opening no device,
    /// so any build on any machine plans for any kind.
    pub fn sizing(self) -> &'static (dyn Sizing + Sync) {
        match self {
            DeviceKind::Cpu => &Cpu,
            DeviceKind::Cuda => &CudaSizing,
        }
    }

    /// Refuses a device number this kind can never have, whatever the machine (the CPU is
    /// device 0 only); a number a kind may have is checked against the machine by
    /// [`DeviceKind::open`].
    fn check_index(self, index: usize) -> Result<()> {
        match self {
            DeviceKind::Cpu if index == 0 => Ok(()),
            DeviceKind::Cpu => bail!(
                "--device cpu:{index}: the CPU backend is one device, cpu:0 (all of this \
                 machine's cores; --threads chooses how many)"
            ),
            DeviceKind::Cuda => Ok(()),
        }
    }

    /// The kind `text` names; errors quote `flag` (the whole `--device` value it came from).
    fn parse_in(text: &str, flag: &str) -> Result<DeviceKind> {
        match text.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda),
            "" => bail!(
                "--device {flag}: no device kind before ':'; give KIND or KIND:N, e.g. cpu or \
                 cpu:0"
            ),
            _ => bail!("--device {flag}: unknown device; the devices are: cpu, cuda (or gpu)"),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<DeviceKind> {
        DeviceKind::parse_in(s, s)
    }
}

/// One device: its kind and its number among the devices of that kind (`--device KIND[:N]`;
/// `KIND` alone is device 0). The default is the CPU, `cpu:0`.
///
/// Prints as the flag takes it, device 0 as its bare kind (`cpu`, `cuda:1`), and is recorded
/// (serde) as that string, so options that recorded a [`DeviceKind`] (`"cpu"`) still load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct DeviceId {
    pub kind: DeviceKind,
    /// The device's number among those of its kind, from 0.
    pub index: usize,
}

impl DeviceId {
    /// The CPU (all of this machine's cores), `cpu:0`: the default.
    pub const CPU: DeviceId = DeviceId {
        kind: DeviceKind::Cpu,
        index: 0,
    };

    /// Opens this device: the backend that plans and runs for it (see [`DeviceKind::open`]).
    pub fn open(self) -> Result<&'static dyn Backend> {
        self.kind.open(self.index)
    }

    /// What the planner asks of this device's backend, without opening it
    /// ([`DeviceKind::sizing`]).
    pub fn sizing(self) -> &'static (dyn Sizing + Sync) {
        self.kind.sizing()
    }

    /// True for the default device, the CPU (options leave it out of what they record, so
    /// the records of CPU runs are as before the field existed).
    pub fn is_default(&self) -> bool {
        *self == DeviceId::default()
    }
}

impl From<DeviceKind> for DeviceId {
    fn from(kind: DeviceKind) -> DeviceId {
        DeviceId { kind, index: 0 }
    }
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            0 => write!(f, "{}", self.kind),
            i => write!(f, "{}:{i}", self.kind),
        }
    }
}

impl std::str::FromStr for DeviceId {
    type Err = anyhow::Error;

    /// `KIND` or `KIND:N` (N decimal digits); refuses a number the kind can never have
    /// (`cpu:1`), naming `--device` and what to give instead.
    fn from_str(s: &str) -> Result<DeviceId> {
        let t = s.trim();
        if t.is_empty() {
            bail!("--device '{s}': give a device, KIND or KIND:N, e.g. cpu or cpu:0");
        }
        let (kind, index) = match t.split_once(':') {
            None => (DeviceKind::parse_in(t, s)?, 0),
            Some((k, n)) => {
                let kind = DeviceKind::parse_in(k, s)?;
                let n = n.trim();
                let index = Some(n)
                    .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|n| n.parse::<usize>().ok());
                let Some(index) = index else {
                    bail!(
                        "--device {s}: '{n}' is not a device number; give KIND:N with N a \
                         number from 0 (e.g. {kind}:0), or KIND alone for device 0"
                    );
                };
                (kind, index)
            }
        };
        kind.check_index(index)?;
        Ok(DeviceId { kind, index })
    }
}

impl TryFrom<String> for DeviceId {
    type Error = anyhow::Error;

    fn try_from(s: String) -> Result<DeviceId> {
        s.parse()
    }
}

impl From<DeviceId> for String {
    fn from(d: DeviceId) -> String {
        d.to_string()
    }
}

/// The backend the tests run on: the device `MEMWALL_TEST_DEVICE` names (`KIND[:N]`, as
/// `--device` takes it; `cpu` when unset). The model-level tests (strategies, packing, masked
/// loss, ranks, references) take their backend from here, so a build with a second backend
/// runs them there with `MEMWALL_TEST_DEVICE=<kind> cargo test`. Panics naming the variable
/// when that device cannot be opened: a test asked for a device must not pass on another.
#[doc(hidden)]
pub fn under_test() -> &'static dyn Backend {
    let var = std::env::var("MEMWALL_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    var.parse::<DeviceId>()
        .and_then(DeviceId::open)
        .unwrap_or_else(|e| panic!("MEMWALL_TEST_DEVICE={var}: {e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_as_the_flag_takes_them() {
        let cpu: DeviceKind = "CPU".parse().unwrap();
        assert_eq!(cpu, DeviceKind::Cpu);
        assert_eq!(cpu.to_string(), "cpu");
        for (name, kind) in [("cuda", DeviceKind::Cuda), ("GPU", DeviceKind::Cuda)] {
            assert_eq!(name.parse::<DeviceKind>().unwrap(), kind);
        }
        assert_eq!(DeviceKind::Cuda.to_string(), "cuda");
        let e = format!("{:#}", "tpu".parse::<DeviceKind>().unwrap_err());
        assert!(
            e.contains("--device tpu") && e.contains("unknown device") && e.contains("cuda"),
            "{e}"
        );
    }

    #[test]
    fn the_cpu_is_device_0_only() {
        assert!(DeviceKind::Cpu.open(0).is_ok());
        let e = format!("{:#}", DeviceKind::Cpu.open(1).err().unwrap());
        assert!(e.contains("--device cpu:1") && e.contains("cpu:0"), "{e}");
        assert!(DeviceId::CPU.open().is_ok());
    }

    #[test]
    fn a_device_is_a_kind_and_an_optional_number() {
        for (text, printed) in [("cpu", "cpu"), ("cpu:0", "cpu"), (" CPU:0 ", "cpu")] {
            let d: DeviceId = text.parse().unwrap();
            assert_eq!(d, DeviceId::CPU, "{text}");
            assert_eq!(d.to_string(), printed);
            assert_eq!(printed.parse::<DeviceId>().unwrap(), d);
        }
        assert!(DeviceId::default().is_default());
        assert_eq!(DeviceId::from(DeviceKind::Cpu), DeviceId::CPU);
        // A number other than 0 prints with it (the form a GPU's would take).
        let one = DeviceId {
            kind: DeviceKind::Cpu,
            index: 1,
        };
        assert_eq!(one.to_string(), "cpu:1");
        assert!(!one.is_default());
    }

    #[test]
    fn bad_devices_are_refused_naming_the_flag() {
        for (bad, says) in [
            ("cpu:1", "one device, cpu:0"),
            ("cpu:x", "'x' is not a device number"),
            ("cpu:-1", "'-1' is not a device number"),
            ("cpu:", "'' is not a device number"),
            ("cpu:+1", "'+1' is not a device number"),
            ("cpu:0:0", "'0:0' is not a device number"),
            (":0", "no device kind before ':'"),
            ("", "give a device"),
            ("cuda:x", "'x' is not a device number"),
            ("tpu:0", "unknown device"),
        ] {
            let e = format!("{:#}", bad.parse::<DeviceId>().unwrap_err());
            assert!(e.contains("--device") && e.contains(says), "{bad}: {e}");
        }
        // The whole value is quoted, not only its kind.
        let e = format!("{:#}", "tpu:1".parse::<DeviceId>().unwrap_err());
        assert!(e.contains("--device tpu:1"), "{e}");
        // GPUs are numbered: any number parses (the machine is asked when the device opens).
        let second: DeviceId = "cuda:1".parse().unwrap();
        assert_eq!((second.kind, second.index), (DeviceKind::Cuda, 1));
        assert_eq!(second.to_string(), "cuda:1");
        assert_eq!("gpu:0".parse::<DeviceId>().unwrap().to_string(), "cuda");
    }

    /// Every kind plans without opening its device: a GPU's plan is made on any machine.
    #[test]
    fn every_kind_has_a_sizing_without_a_device() {
        use crate::ir::Tier;
        assert_eq!(DeviceKind::Cpu.sizing().tiers()[0], Tier::Host);
        assert_eq!(DeviceKind::Cuda.sizing().tiers()[0], Tier::Device);
    }

    #[test]
    fn a_device_is_recorded_as_the_flag_writes_it() {
        assert_eq!(serde_json::to_string(&DeviceId::CPU).unwrap(), "\"cpu\"");
        // What options recorded when they held a DeviceKind, and the long form, both load.
        let kind = serde_json::to_string(&DeviceKind::Cpu).unwrap();
        assert_eq!(
            serde_json::from_str::<DeviceId>(&kind).unwrap(),
            DeviceId::CPU
        );
        let long: DeviceId = serde_json::from_str("\"cpu:0\"").unwrap();
        assert_eq!(long, DeviceId::CPU);
        let e = serde_json::from_str::<DeviceId>("\"cpu:1\"").unwrap_err();
        assert!(e.to_string().contains("--device cpu:1"), "{e}");
    }
}
