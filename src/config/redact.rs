//! Locations that are safe to show. A database URL or a webhook URL may carry a credential in its
//! user info (`postgres://user:secret@host`) or in its query (`?password=…`, `?sslpassword=…`,
//! `?code=…` for a function key, `?sig=…` for a SAS): wherever a location reaches a log line, an
//! error or an HTTP answer, it goes through here first.

/// Query parameter names (lowercased) that carry a credential, matched as substrings, plus a few
/// exact names too short to match safely as substrings.
const SECRET_PARAMETER_PARTS: [&str; 7] = ["pass", "pwd", "secret", "token", "key", "sig", "credential"];
const SECRET_PARAMETER_NAMES: [&str; 2] = ["code", "auth"];

/// What replaces a secret.
pub const MASK: &str = "***";

/// The part of a URL safe to print: scheme, host and port. A path may hold a token as much as the
/// user info or the query may (chat hooks carry theirs in the path), so none of them is shown: in
/// logs, errors, `last_error`, status, alerts and quarantine entries alike.
pub fn shown_endpoint(url: &url::Url) -> String {
    let port = url.port().map(|port| format!(":{port}")).unwrap_or_default();
    format!("{}://{}{port}", url.scheme(), url.host_str().unwrap_or_default())
}

/// Text a peer sent (a receiver's answer, a database's or a storage service's error message),
/// made safe for one log line or one stored error: every control character (newlines, carriage
/// returns, escape sequences, C1 controls) and every character that reorders or separates lines
/// (Unicode line and paragraph separators, bidirectional overrides) is written as an escape
/// (`\n`, `\u{1b}`). A peer can then never start a line of its own in the log, such as a forged
/// `tick … outcome=caught_up` that an alert rule would match. Applied where the text enters.
pub fn escape_peer_text(text: &str) -> String {
    let needs_escaping = |character: char| {
        character.is_control()
            || matches!(character, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}')
            || ('\u{202a}'..='\u{202e}').contains(&character)
            || ('\u{2066}'..='\u{2069}').contains(&character)
    };
    if !text.chars().any(needs_escaping) {
        return text.to_string();
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for character in text.chars() {
        if needs_escaping(character) {
            escaped.extend(character.escape_default());
        } else {
            escaped.push(character);
        }
    }
    escaped
}

/// Whether a query parameter of this name carries a credential.
pub fn is_secret_parameter(name: &str) -> bool {
    let lowered = name.to_ascii_lowercase();
    SECRET_PARAMETER_NAMES.contains(&lowered.as_str())
        || SECRET_PARAMETER_PARTS.iter().any(|part| lowered.contains(part))
}

/// A URL with every credential replaced by `***`: the user-info password and the value of every
/// credential-bearing query parameter. Text that is not a URL keeps only what precedes its `?`
/// and any `@` (so a malformed URL with a secret in it still prints nothing secret).
pub fn redacted_url(text: &str) -> String {
    // A text like `user:secret@host` parses as a URL of scheme `user` with an opaque path: only a
    // URL with an authority is taken apart, anything else is cut.
    let Some(mut parsed) = url::Url::parse(text).ok().filter(|parsed| !parsed.cannot_be_a_base()) else {
        let before_query = text.split('?').next().unwrap_or_default();
        return match before_query.rsplit_once('@') {
            Some((_, host)) => format!("{MASK}@{host}"),
            None => before_query.to_string(),
        };
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some(MASK));
    }
    if parsed.query().is_some() {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(name, value)| {
                let shown = if is_secret_parameter(&name) { MASK.to_string() } else { value.into_owned() };
                (name.into_owned(), shown)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

/// The secret values a URL holds (user-info password and credential parameters), raw and
/// percent-decoded, so that text from elsewhere (a driver's error message) can be scrubbed of them.
pub fn url_secrets(text: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    let Ok(parsed) = url::Url::parse(text) else {
        return secrets;
    };
    if let Some(password) = parsed.password() {
        secrets.push(password.to_string());
        if let Ok(decoded) = percent_decode(password) {
            secrets.push(decoded);
        }
    }
    for (name, value) in parsed.query_pairs() {
        if is_secret_parameter(&name) && !value.is_empty() {
            secrets.push(value.into_owned());
        }
    }
    if let Some(query) = parsed.query() {
        for pair in query.split('&') {
            if let Some((name, value)) = pair.split_once('=')
                && is_secret_parameter(name)
                && !value.is_empty()
            {
                secrets.push(value.to_string());
            }
        }
    }
    // Longest first, so that a secret containing another is replaced whole.
    secrets.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
    secrets.dedup();
    secrets
}

fn percent_decode(text: &str) -> Result<String, std::string::FromUtf8Error> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = |offset: usize| bytes.get(offset).and_then(|byte| (*byte as char).to_digit(16));
        match (bytes[index], hex(index + 1), hex(index + 2)) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                index += 3;
            }
            (byte, _, _) => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8(decoded)
}

/// A location to show, and the secrets to scrub from any text about it.
#[derive(Clone)]
pub struct Redaction {
    /// The URL with its credentials masked.
    pub location: String,
    secrets: Vec<String>,
}

impl Redaction {
    pub fn of_url(url: &str) -> Self {
        Redaction { location: redacted_url(url), secrets: url_secrets(url) }
    }

    /// `text` with every secret of the URL replaced by `***`, then escaped as text from a peer
    /// ([`escape_peer_text`]): what is scrubbed is a driver's or a server's message. Replaced
    /// first: a secret holding a character the escaping rewrites (a control or bidi character)
    /// would no longer match once escaped, and would leak in its escaped form.
    pub fn scrub(&self, text: &str) -> String {
        let mut scrubbed = text.to_string();
        for secret in &self.secrets {
            if scrubbed.contains(secret.as_str()) {
                scrubbed = scrubbed.replace(secret.as_str(), MASK);
            }
        }
        escape_peer_text(&scrubbed)
    }
}

impl std::fmt::Debug for Redaction {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Redaction").field("location", &self.location).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 9, item 4): a password in the query of a database URL is masked like one
    /// in its user info, and so are the other credential parameters.
    #[test]
    fn credentials_in_the_query_are_masked() {
        let shown =
            redacted_url("postgres://app@db.example:5432/orders?sslmode=require&password=S3cret&sslpassword=K3y");
        assert!(!shown.contains("S3cret") && !shown.contains("K3y"), "{shown}");
        assert!(shown.contains("sslmode=require") && shown.contains("password=***"), "{shown}");
        let shown = redacted_url("postgres://app:Hunter2@db.example/orders");
        assert!(!shown.contains("Hunter2") && shown.contains("app:***@"), "{shown}");
        let shown = redacted_url("https://fn.example/api/hook?code=FunctionKey&x=1");
        assert_eq!(shown, "https://fn.example/api/hook?code=***&x=1");
        assert_eq!(redacted_url("not a url?password=S3cret"), "not a url");
        assert_eq!(redacted_url("user:S3cret@host/db"), "***@host/db");
    }

    /// Regression (issue 30, item 4): text a peer sends (a receiver's answer, a server's error)
    /// cannot start a line of its own: newlines, carriage returns, escape sequences, line
    /// separators and bidirectional overrides are escaped, the rest kept as it is.
    #[test]
    fn peer_text_is_escaped_onto_one_line() {
        let forged = "no\nINFO tick outcome=caught_up\r\x1b[2J\u{2028}\u{202e}é \"quoted\" \\ end";
        let escaped = escape_peer_text(forged);
        assert_eq!(escaped, "no\\nINFO tick outcome=caught_up\\r\\u{1b}[2J\\u{2028}\\u{202e}é \"quoted\" \\ end");
        assert!(!escaped.chars().any(|character| character.is_control()), "{escaped:?}");
        assert_eq!(escape_peer_text("plain text"), "plain text");
        let redaction = Redaction::of_url("postgres://app:S3cret@db/orders");
        assert_eq!(redaction.scrub("bad\npassword S3cret"), "bad\\npassword ***");
    }

    /// Regression (issue 36, section 3): a password holding a control or bidi character is
    /// replaced before the text is escaped, so it never leaks in its escaped form.
    #[test]
    fn a_secret_with_control_or_bidi_characters_is_replaced_before_escaping() {
        let redaction = Redaction::of_url("postgres://app:Se%0Acr%E2%80%AEet@db/orders");
        let scrubbed = redaction.scrub("auth failed for Se\ncr\u{202e}et\nINFO forged");
        assert_eq!(scrubbed, "auth failed for ***\\nINFO forged");
        assert!(!scrubbed.contains("Se\\ncr") && !scrubbed.contains("et\\n"), "{scrubbed}");
    }

    #[test]
    fn scrubbing_removes_every_form_of_the_secret() {
        let redaction = Redaction::of_url("mysql://app:p%40ss@db/orders?password=Other%21");
        let scrubbed = redaction.scrub("failed for p@ss and p%40ss and Other! and Other%21");
        assert_eq!(scrubbed, "failed for *** and *** and *** and ***");
    }
}
