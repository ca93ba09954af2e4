//! Checked conversion of enum-like integers that come in from C.
//!
//! A Rust enum is never a parameter of an exported function: C may pass any
//! integer, and an out-of-range value in a Rust enum is undefined behaviour.
//! Parameters are `int32_t`, converted here into the enum or a clear error.

use super::boundary::{FfiError, FfiResult};

/// An enum that C passes as an `int32_t`.
pub trait CEnum: Sized + Copy + 'static {
    /// The C type name, for messages.
    const NAME: &'static str;
    /// Every variant.
    const ALL: &'static [Self];
    fn to_i32(self) -> i32;

    /// The variant for `value`, or an `InvalidArgument` error that names the type
    /// and the valid values.
    fn from_c(value: i32) -> FfiResult<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|v| v.to_i32() == value)
            .ok_or_else(|| {
                let valid: Vec<String> = Self::ALL.iter().map(|v| v.to_i32().to_string()).collect();
                FfiError::invalid(format!(
                    "{value} is not a valid {} (valid: {})",
                    Self::NAME,
                    valid.join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Two {
        A = 0,
        B = 5,
    }
    impl CEnum for Two {
        const NAME: &'static str = "two";
        const ALL: &'static [Self] = &[Two::A, Two::B];
        fn to_i32(self) -> i32 {
            self as i32
        }
    }

    #[test]
    fn checked() {
        assert_eq!(Two::from_c(0).unwrap(), Two::A);
        assert_eq!(Two::from_c(5).unwrap(), Two::B);
        let e = Two::from_c(1).unwrap_err();
        assert!(
            e.message.contains("1 is not a valid two (valid: 0, 5)"),
            "{e}"
        );
        assert!(Two::from_c(i32::MIN).is_err());
    }
}
