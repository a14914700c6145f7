//! A log writer for tests that read what a `tracing` subscriber wrote.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Keeps everything written to it; clones share it. Give it to a subscriber as its writer
/// (`.with_writer(move || log.clone())`), then read [`CapturedLog::text`].
#[derive(Debug, Clone, Default)]
pub struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    /// What was written so far, as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&crate::lock(&self.0)).into_owned()
    }
}

impl Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
