//! Validation of the `alerts` section: where `alert_at` crossings are delivered.

use super::raw::*;
use super::source::Merged;
use super::types::AlertsCfg;
use super::validate::V;

impl V<'_> {
    pub(super) fn alerts_cfg(&mut self, m: &Merged) -> AlertsCfg {
        let sec = m.alerts.as_ref();
        let f = sec.map_or(0, |s| s.file);
        let raw = sec.map(|s| &s.v);
        let webhook_url = match raw.and_then(|r| r.webhook_url.as_deref()).map(str::trim) {
            None => None,
            Some("") => self.err(
                f,
                "alerts.webhook_url",
                "must not be empty (omit it to log only)",
            ),
            Some(u) => {
                let host = u
                    .strip_prefix("https://")
                    .or_else(|| u.strip_prefix("http://"))
                    .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or(""));
                match host {
                    Some(h) if !h.is_empty() && !h.contains(char::is_whitespace) => {
                        Some(u.to_owned())
                    }
                    _ => self.err(
                        f,
                        "alerts.webhook_url",
                        format!("`{u}` must be an http:// or https:// URL with a host"),
                    ),
                }
            }
        };
        let timeout = self.dur(
            f,
            "alerts.timeout".into(),
            raw.and_then(|r| r.timeout.as_ref()),
            DEFAULT_ALERT_TIMEOUT,
            true,
        );
        let queue = self.nonzero(
            f,
            "alerts.queue".into(),
            raw.and_then(|r| r.queue.as_ref()),
            DEFAULT_ALERT_QUEUE,
        );
        let max_attempts = self.nonzero(
            f,
            "alerts.max_attempts".into(),
            raw.and_then(|r| r.max_attempts.as_ref()),
            DEFAULT_ALERT_ATTEMPTS,
        );
        AlertsCfg {
            webhook_url,
            timeout,
            queue,
            max_attempts,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::{from_str, PolicyErrors};
    use std::time::Duration;

    const BASE: &str = "version: a-1
backends:
  - {id: primary, kind: openai, base_url: 'http://127.0.0.1:9/v1'}
routes:
  - model: chat
    chain: [{backend: primary, model: small}]
";

    #[test]
    fn absent_section_logs_only_with_defaults() {
        let p = from_str(BASE, "p.yaml").expect("valid");
        assert_eq!(p.alerts.webhook_url, None);
        assert_eq!(p.alerts.timeout, Duration::from_secs(5));
        assert_eq!((p.alerts.queue, p.alerts.max_attempts), (256, 5));
    }

    #[test]
    fn webhook_and_timeout_are_read() {
        let src = format!(
            "{BASE}alerts: {{webhook_url: 'https://hooks.example.com/x?y=1', timeout: 750ms, queue: 8, max_attempts: 3}}\n"
        );
        let p = from_str(&src, "p.yaml").expect("valid");
        assert_eq!(
            p.alerts.webhook_url.as_deref(),
            Some("https://hooks.example.com/x?y=1")
        );
        assert_eq!(p.alerts.timeout, Duration::from_millis(750));
        assert_eq!((p.alerts.queue, p.alerts.max_attempts), (8, 3));
    }

    fn errs(src: &str) -> String {
        match from_str(src, "p.yaml") {
            Ok(_) => panic!("unexpectedly valid:\n{src}"),
            Err(e) => PolicyErrors(e.0).to_string(),
        }
    }

    #[test]
    fn bad_values_name_line_and_key() {
        let e = errs(&format!("{BASE}alerts:\n  webhook_url: ftp://x\n"));
        assert!(
            e.contains("p.yaml:8") && e.contains("alerts.webhook_url"),
            "{e}"
        );
        let e = errs(&format!("{BASE}alerts: {{webhook_url: 'http://'}}\n"));
        assert!(e.contains("alerts.webhook_url"), "{e}");
        let e = errs(&format!("{BASE}alerts: {{timeout: 0s}}\n"));
        assert!(
            e.contains("alerts.timeout") && e.contains("longer than zero"),
            "{e}"
        );
        let e = errs(&format!("{BASE}alerts: {{queue: 0}}\n"));
        assert!(e.contains("alerts.queue"), "{e}");
        let e = errs(&format!("{BASE}alerts: {{webhook: 'http://x'}}\n"));
        assert!(e.contains("webhook"), "{e}");
    }
}
