//! The one error type of the core; `rust/ext` maps it to Python exceptions.

use std::fmt;

/// Everything the core can refuse. Messages name what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// The request does not match the model's inputs; the message says how.
    InvalidInput(String),
    /// `max_queue_size` requests are already waiting.
    QueueFull { capacity: usize },
    /// The batcher is closed to new requests.
    Closed,
    /// A configuration value is out of range.
    InvalidConfig(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidInput(msg) => f.write_str(msg),
            CoreError::QueueFull { capacity } => {
                write!(
                    f,
                    "queue is full: {capacity} requests are already waiting (max_queue_size)"
                )
            }
            CoreError::Closed => f.write_str("server is closed to new requests"),
            CoreError::InvalidConfig(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for CoreError {}
