//! Which backend runs a plan: `--device`, chosen once where the user's request is resolved
//! and carried in the options as a [`DeviceKind`]; everything after asks it for its
//! [`Backend`]. A second backend is one more arm of [`DeviceKind::backend`].

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
    /// The backend that plans and runs for this device.
    pub fn backend(self) -> &'static dyn Backend {
        match self {
            DeviceKind::Cpu => &Cpu,
        }
    }

    /// True for the CPU (the default; options leave it out of what they record).
    pub fn is_cpu(&self) -> bool {
        *self == DeviceKind::Cpu
    }
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
}
