//! The CUDA C sources of libgwtf's kernels, embedded in the library.
//!
//! Each kernel has a CPU twin with identical semantics (src/model/kernels.rs
//! and src/model/ops.rs); the GPU tests compare the two. Sources are compiled
//! at run time by NVRTC ([`super::nvrtc`]) with `--fmad=false`, so that the
//! elementwise kernels round exactly like the CPU code.

/// One compilation unit: a `.cu` file and the entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub file: &'static str,
    pub source: &'static str,
    pub entries: &'static [&'static str],
}

/// Helpers prepended to every unit (NVRTC gets no file system).
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// Every kernel unit of the library.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "quantize.cu",
        source: include_str!("kernels/quantize.cu"),
        entries: &[
            "gwtf_f32_to_bf16",
            "gwtf_bf16_to_f32",
            "gwtf_quantize_int8",
            "gwtf_dequantize_int8",
        ],
    },
    KernelSource {
        file: "average.cu",
        source: include_str!("kernels/average.cu"),
        entries: &["gwtf_weighted_average"],
    },
    KernelSource {
        file: "adamw.cu",
        source: include_str!("kernels/adamw.cu"),
        entries: &["gwtf_adamw"],
    },
    KernelSource {
        file: "norm.cu",
        source: include_str!("kernels/norm.cu"),
        entries: &[
            "gwtf_rmsnorm_forward",
            "gwtf_rmsnorm_backward",
            "gwtf_layernorm_forward",
            "gwtf_layernorm_backward",
        ],
    },
    KernelSource {
        file: "activation.cu",
        source: include_str!("kernels/activation.cu"),
        entries: &[
            "gwtf_gelu_forward",
            "gwtf_gelu_backward",
            "gwtf_swiglu_forward",
            "gwtf_swiglu_backward",
        ],
    },
    KernelSource {
        file: "rope.cu",
        source: include_str!("kernels/rope.cu"),
        entries: &["gwtf_rope"],
    },
    KernelSource {
        file: "softmax.cu",
        source: include_str!("kernels/softmax.cu"),
        entries: &["gwtf_crossentropy_forward", "gwtf_crossentropy_backward"],
    },
    KernelSource {
        file: "encoder.cu",
        source: include_str!("kernels/encoder.cu"),
        entries: &[
            "gwtf_encoder_forward",
            "gwtf_encoder_backward_wte",
            "gwtf_encoder_backward_wpe",
        ],
    },
    KernelSource {
        file: "residual.cu",
        source: include_str!("kernels/residual.cu"),
        entries: &[
            "gwtf_add_inplace",
            "gwtf_bias_forward",
            "gwtf_bias_backward",
        ],
    },
    KernelSource {
        file: "attention.cu",
        source: include_str!("kernels/attention.cu"),
        entries: &[
            "gwtf_attention_forward",
            "gwtf_attention_backward_query",
            "gwtf_attention_backward_key_value",
        ],
    },
];

impl KernelSource {
    /// The text NVRTC compiles: the shared helpers, then the unit.
    pub fn full_source(&self) -> String {
        let common = COMMON.replace("#pragma once", "");
        format!("{common}\n// ---- {}\n{}", self.file, self.source)
    }
}

/// The unit that defines `entry`.
pub fn source_of(entry: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.entries.contains(&entry))
}
