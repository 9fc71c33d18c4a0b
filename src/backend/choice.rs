//! Which backend runs a plan: `--device`, chosen once where the user's request is resolved
//! and carried in the options as a [`DeviceKind`]; everything after opens it
//! ([`DeviceKind::open`], which can fail: a GPU may be missing, busy or out of memory) for its
//! [`Backend`]. A second backend is one more arm of [`DeviceKind::open`].

use super::Backend;
use super::cpu::Cpu;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// A backend memwall can run on (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// This machine's cores (`backend::cpu`).
    #[default]
    Cpu,
}

impl DeviceKind {
    /// Opens device `index` of this kind (GPUs are numbered from 0; the CPU, all of this
    /// machine's cores, is the one device 0): the backend that plans and runs for it, opened
    /// once per process. Fails naming the device when there is no such one.
    pub fn open(self, index: usize) -> Result<&'static dyn Backend> {
        match self {
            DeviceKind::Cpu if index == 0 => Ok(&Cpu),
            DeviceKind::Cpu => bail!(
                "device cpu:{index}: the CPU backend is one device, cpu:0 (all of this \
                 machine's cores; --threads chooses how many)"
            ),
        }
    }

    /// True for the CPU (the default; options leave it out of what they record).
    pub fn is_cpu(&self) -> bool {
        *self == DeviceKind::Cpu
    }
}

/// The backend the tests run on: device 0 of the kind `MEMWALL_TEST_DEVICE` names (`cpu`
/// when unset). The model-level tests (strategies, packing, masked loss, ranks, references)
/// take their backend from here, so a build with a second backend runs them there with
/// `MEMWALL_TEST_DEVICE=<kind> cargo test`. Panics naming the variable when that device
/// cannot be opened: a test asked for a device must not pass on another.
#[doc(hidden)]
pub fn under_test() -> &'static dyn Backend {
    let var = std::env::var("MEMWALL_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    var.parse::<DeviceKind>()
        .and_then(|k| k.open(0))
        .unwrap_or_else(|e| panic!("MEMWALL_TEST_DEVICE={var}: {e:#}"))
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
        })
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<DeviceKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => bail!(
                "--device {s}: this build has no GPU backend yet; use --device cpu (the default)"
            ),
            _ => bail!("--device {s}: unknown device; the devices are: cpu"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_as_the_flag_takes_them() {
        let cpu: DeviceKind = "CPU".parse().unwrap();
        assert_eq!(cpu, DeviceKind::Cpu);
        assert_eq!(cpu.to_string(), "cpu");
        for (bad, says) in [("cuda", "no GPU backend"), ("tpu", "unknown device")] {
            let e = format!("{:#}", bad.parse::<DeviceKind>().unwrap_err());
            assert!(
                e.contains(&format!("--device {bad}")) && e.contains(says),
                "{e}"
            );
        }
    }

    #[test]
    fn the_cpu_is_device_0_only() {
        assert!(DeviceKind::Cpu.open(0).is_ok());
        let e = format!("{:#}", DeviceKind::Cpu.open(1).err().unwrap());
        assert!(e.contains("cpu:1") && e.contains("cpu:0"), "{e}");
    }
}
