//! The one rule for a caller's timeout, whatever way it came in (in process,
//! a blocked thread, shared memory, HTTP, gRPC): seconds from submit to a
//! deadline, checked and converted here only.

use std::fmt;
use std::time::Duration;

/// A timeout a caller may not give: NaN or negative.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InvalidTimeout(pub f64);

impl fmt::Display for InvalidTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timeout must be a number of seconds >= 0, got {}",
            self.0
        )
    }
}

impl std::error::Error for InvalidTimeout {}

/// The deadline offset of a timeout of `seconds`: `None` for one too long
/// to represent (infinity, 1e300: no deadline at all), an error for NaN or a
/// negative one.
pub fn timeout_from_secs(seconds: f64) -> Result<Option<Duration>, InvalidTimeout> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(InvalidTimeout(seconds));
    }
    Ok(Duration::try_from_secs_f64(seconds).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_become_deadline_offsets_or_errors() {
        assert_eq!(
            timeout_from_secs(0.25),
            Ok(Some(Duration::from_millis(250)))
        );
        assert_eq!(timeout_from_secs(0.0), Ok(Some(Duration::ZERO)));
        assert_eq!(timeout_from_secs(f64::INFINITY), Ok(None));
        assert_eq!(timeout_from_secs(1e300), Ok(None));
        assert!(timeout_from_secs(-1.0).is_err());
        assert!(timeout_from_secs(f64::NAN).is_err());
        assert_eq!(
            timeout_from_secs(-0.5).unwrap_err().to_string(),
            "timeout must be a number of seconds >= 0, got -0.5"
        );
    }
}
