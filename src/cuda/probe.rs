//! Is CUDA usable here, and with which devices?

use std::fmt;

/// What the probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeState {
    /// This build of libgwtf has no CUDA support (the `cuda` feature is off).
    Disabled,
    /// No CUDA driver library (libcuda) could be loaded.
    NoDriver,
    /// The driver loaded, but it reports no CUDA device.
    NoDevice,
    /// The driver loaded, but initialising it (or a device query) failed.
    InitError,
    /// At least one device is ready.
    Ready,
}

impl ProbeState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::NoDriver => "no-driver",
            Self::NoDevice => "no-device",
            Self::InitError => "init-error",
            Self::Ready => "ready",
        }
    }
}

/// How much the probe should find out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeDetail {
    /// Only whether CUDA works and how many devices there are.
    CountOnly,
    /// Also each device's name, memory and compute capability.
    Devices,
}

/// One CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub total_memory_bytes: u64,
    /// (major, minor), e.g. (9, 0) for an H100.
    pub compute_capability: (i32, i32),
}

/// The answer of [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    pub state: ProbeState,
    /// Number of devices (also filled with `ProbeDetail::CountOnly`).
    pub device_count: u32,
    /// Per-device details (empty with `ProbeDetail::CountOnly`).
    pub devices: Vec<DeviceInfo>,
    /// The driver's CUDA version as the driver encodes it (e.g. 12040), if known.
    pub driver_version: Option<i32>,
    /// The CUDA error name when a driver call failed, e.g. "CUDA_ERROR_NO_DEVICE".
    pub error_name: Option<String>,
}

impl ProbeReport {
    fn failed(state: ProbeState, error_name: Option<String>, driver_version: Option<i32>) -> Self {
        Self {
            state,
            device_count: 0,
            devices: Vec::new(),
            driver_version,
            error_name,
        }
    }
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.state {
            ProbeState::Disabled => write!(f, "CUDA support is not built into this libgwtf"),
            ProbeState::NoDriver => write!(f, "no CUDA driver library (libcuda.so) found"),
            ProbeState::NoDevice => write!(
                f,
                "CUDA driver present but no device ({})",
                self.error_name.as_deref().unwrap_or("device count is 0")
            ),
            ProbeState::InitError => write!(
                f,
                "CUDA driver present but initialisation failed ({})",
                self.error_name.as_deref().unwrap_or("unknown error")
            ),
            ProbeState::Ready => {
                write!(f, "{} CUDA device(s)", self.device_count)?;
                if let Some(v) = self.driver_version {
                    write!(f, ", driver CUDA {}.{}", v / 1000, (v % 1000) / 10)?;
                }
                for d in &self.devices {
                    write!(
                        f,
                        "\n  {}: {} ({:.1} GiB, sm_{}{})",
                        d.ordinal,
                        d.name,
                        d.total_memory_bytes as f64 / (1u64 << 30) as f64,
                        d.compute_capability.0,
                        d.compute_capability.1
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// Finds out whether CUDA can be used, without ever crashing the process.
pub fn probe(detail: ProbeDetail) -> ProbeReport {
    imp::probe(detail)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;
    pub fn probe(_detail: ProbeDetail) -> ProbeReport {
        ProbeReport::failed(ProbeState::Disabled, None, None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use cudarc::driver::{result, sys, DriverError};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    fn name_of(e: &DriverError) -> String {
        // The enum variant's name is the CUDA error name; it needs no driver call.
        format!("{:?}", e.0)
    }

    pub fn probe(detail: ProbeDetail) -> ProbeReport {
        // SAFETY: only tries to dlopen candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return ProbeReport::failed(ProbeState::NoDriver, None, None);
        }
        // A driver library that lacks a symbol makes cudarc panic: contain it.
        match catch_unwind(AssertUnwindSafe(|| probe_driver(detail))) {
            Ok(report) => report,
            Err(_) => ProbeReport::failed(
                ProbeState::InitError,
                Some("driver library is missing an expected symbol".into()),
                None,
            ),
        }
    }

    fn probe_driver(detail: ProbeDetail) -> ProbeReport {
        if let Err(e) = result::init() {
            let state = if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
                ProbeState::NoDevice
            } else {
                ProbeState::InitError
            };
            return ProbeReport::failed(state, Some(name_of(&e)), None);
        }
        let mut version = 0;
        // SAFETY: plain out-parameter call after a successful cuInit.
        let driver_version = unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .ok()
            .map(|_| version);
        let count = match result::device::get_count() {
            Ok(c) => c.max(0) as u32,
            Err(e) => {
                return ProbeReport::failed(
                    ProbeState::InitError,
                    Some(name_of(&e)),
                    driver_version,
                )
            }
        };
        if count == 0 {
            return ProbeReport::failed(ProbeState::NoDevice, None, driver_version);
        }
        let mut devices = Vec::new();
        if detail == ProbeDetail::Devices {
            for ordinal in 0..count {
                match device_info(ordinal) {
                    Ok(d) => devices.push(d),
                    Err(e) => {
                        return ProbeReport::failed(
                            ProbeState::InitError,
                            Some(name_of(&e)),
                            driver_version,
                        )
                    }
                }
            }
        }
        ProbeReport {
            state: ProbeState::Ready,
            device_count: count,
            devices,
            driver_version,
            error_name: None,
        }
    }

    fn device_info(ordinal: u32) -> Result<DeviceInfo, DriverError> {
        use sys::CUdevice_attribute::*;
        let dev = result::device::get(ordinal as i32)?;
        let name = result::device::get_name(dev)?;
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        let total = unsafe { result::device::total_mem(dev)? };
        // SAFETY: as above; the attributes are plain integers.
        let major = unsafe {
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?
        };
        // SAFETY: as above.
        let minor = unsafe {
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?
        };
        Ok(DeviceInfo {
            ordinal,
            name,
            total_memory_bytes: total as u64,
            compute_capability: (major, minor),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_is_consistent() {
        let r = probe(ProbeDetail::Devices);
        match r.state {
            ProbeState::Ready => {
                assert!(r.device_count > 0);
                assert_eq!(r.devices.len() as u32, r.device_count);
            }
            _ => {
                assert_eq!(r.device_count, 0);
                assert!(r.devices.is_empty());
            }
        }
        assert!(!r.to_string().is_empty());
    }
}
