//! Argument checks shared by the subcommands, so that a bad value or an
//! unwritable output is refused before any work starts, with a message that
//! names the flag and the value.
//!
//! The number parsers are clap value parsers: clap then reports
//! `invalid value '-1' for '--churn-per-hour <..>': must be >= 0, got -1` and
//! exits before the command runs. Flags using them also set
//! `allow_negative_numbers`, so that `-1` reaches the parser instead of being
//! taken for an unknown flag.
use std::fs::OpenOptions;
use std::path::Path;

/// An integer of type `T` that is at least `min` (negative input gets the same
/// message instead of a bare "invalid digit").
pub fn int_at_least<T>(min: i128) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<i128>,
{
    move |s| {
        let v: i128 = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a whole number"))?;
        if v < min {
            return Err(format!("must be >= {min}, got {v}"));
        }
        T::try_from(v).map_err(|_| format!("{v} is too large"))
    }
}

/// An integer of type `T` in `lo..=hi`.
pub fn int_in<T>(lo: i128, hi: i128) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<i128>,
{
    let at_least = int_at_least::<i128>(lo);
    move |s| {
        let v = at_least(s)?;
        if v > hi {
            return Err(format!("must be <= {hi}, got {v}"));
        }
        T::try_from(v).map_err(|_| format!("{v} is too large"))
    }
}

/// A finite number in `lo..=hi` (NaN and infinities are refused).
pub fn float_in(lo: f64, hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    move |s| {
        let v: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a number"))?;
        if !v.is_finite() {
            return Err(format!("must be a finite number, got {s}"));
        }
        if v < lo {
            return Err(format!("must be >= {lo}, got {s}"));
        }
        if v > hi {
            return Err(format!("must be <= {hi}, got {s}"));
        }
        Ok(v)
    }
}

/// A finite number strictly greater than zero.
pub fn positive_float(s: &str) -> Result<f64, String> {
    let v = float_in(f64::MIN, f64::MAX)(s)?;
    if v <= 0.0 {
        return Err(format!("must be > 0, got {s}"));
    }
    Ok(v)
}

/// Checks that `path` (given with `flag`) can be written, by opening it for
/// appending (which leaves an existing file's content alone) and removing it
/// again if it did not exist. Run before a long computation so that its result
/// is not lost to a typo in the output path.
pub fn writable_output(flag: &str, path: &Path) -> Result<(), String> {
    let shown = path.display();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.exists() {
        return Err(format!(
            "cannot write {flag} {shown}: directory {} does not exist",
            dir.display()
        ));
    }
    if !dir.is_dir() {
        return Err(format!(
            "cannot write {flag} {shown}: {} is not a directory",
            dir.display()
        ));
    }
    if path.is_dir() {
        return Err(format!("cannot write {flag} {shown}: it is a directory"));
    }
    let existed = path.exists();
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| format!("cannot write {flag} {shown}: {e}"))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(int_at_least::<u32>(1)("3"), Ok(3));
        assert_eq!(
            int_at_least::<u32>(1)("0").unwrap_err(),
            "must be >= 1, got 0"
        );
        assert_eq!(
            int_at_least::<u32>(0)("-2").unwrap_err(),
            "must be >= 0, got -2"
        );
        assert!(int_at_least::<u8>(0)("300").unwrap_err().contains("large"));
        assert_eq!(float_in(0.0, 1.0)("0.5"), Ok(0.5));
        assert_eq!(
            float_in(0.0, 1.0)("-1").unwrap_err(),
            "must be >= 0, got -1"
        );
        assert!(float_in(0.0, 1.0)("NaN").unwrap_err().contains("finite"));
        assert!(positive_float("0").is_err());
    }
}
