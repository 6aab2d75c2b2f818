//! A database login by the app's managed identity: app setting `<connection>__credential` =
//! `managedidentity` (and `<connection>__clientId` for a user-assigned identity) beside the
//! connection setting, spelled as Functions' identity-based connections are. The URL then names the
//! user (the identity's database role) and no password: the password of each connection is a
//! Microsoft Entra token, asked for as connections open (`source::entra`). A token crosses the
//! network as the password, so TLS is required unless the host is loopback.

use super::source_types::{DatabaseIdentity, Engine, SourceConfig};
use super::tls::{TransportSecurity, transport_security};
use crate::settings::Settings;

/// The only `__credential` value there is for a database.
pub const MANAGED_IDENTITY: &str = "managedidentity";

/// The identity app setting `connection`'s URL logs in with, if any; an error names the setting
/// (and never quotes the URL).
pub(super) fn database_identity(
    connection: &str,
    settings: &Settings,
    engine: Engine,
    url: &str,
) -> Result<Option<DatabaseIdentity>, String> {
    let setting = format!("{connection}__credential");
    let client_setting = format!("{connection}__clientId");
    let client_id = settings.get(&client_setting).map(str::trim).filter(|id| !id.is_empty()).map(str::to_string);
    let Some(credential) = settings.get(&setting).map(str::trim).filter(|value| !value.is_empty()) else {
        if client_id.is_some() {
            return Err(format!(
                "app setting {client_setting} is set but {setting} is not: set {setting} = {MANAGED_IDENTITY} to log in \
                 with that identity, or remove {client_setting}"
            ));
        }
        return Ok(None);
    };
    if !credential.eq_ignore_ascii_case(MANAGED_IDENTITY) {
        return Err(format!(
            "app setting {setting}: expected {MANAGED_IDENTITY}, the only credential a database takes"
        ));
    }
    if engine == Engine::Sqlite {
        return Err(format!("app setting {setting}: a sqlite file has no login; remove {setting}"));
    }
    let parsed = url::Url::parse(url).map_err(|_| format!("app setting {connection}: not a valid URL"))?;
    if parsed.username().is_empty() {
        return Err(format!(
            "app setting {connection}: the URL names no user; with {setting} = {MANAGED_IDENTITY} the user is the \
             identity's database role (docs/identity.md, \"Database login by managed identity\")"
        ));
    }
    if parsed.password().is_some() {
        return Err(format!(
            "app setting {connection}: the URL has a password, and {setting} = {MANAGED_IDENTITY} makes the \
             identity's token the password; remove the password from the URL"
        ));
    }
    Ok(Some(DatabaseIdentity { setting, client_id }))
}

/// A source logging in by identity must not send its token in plaintext: its URL must require TLS
/// unless the server is on this machine.
pub(super) fn require_tls(source: &SourceConfig) -> Result<(), String> {
    let Some(identity) = &source.identity else {
        return Ok(());
    };
    match transport_security(source) {
        TransportSecurity::Unverified { host, mode } if super::tls::may_be_plaintext(&mode) => Err(format!(
            "app setting {}: the connection to {host} ({mode}) may run in plaintext, and {} = {MANAGED_IDENTITY} \
             sends a token as the password; add {} to the URL",
            source.connection,
            identity.setting,
            match source.engine {
                Engine::MySql => "ssl-mode=VERIFY_IDENTITY",
                _ => "sslmode=verify-full",
            }
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Settings {
        Settings::from_pairs(pairs.iter().copied())
    }

    #[test]
    fn the_credential_setting_is_read_beside_the_connection_and_checked() {
        let url = "postgres://orders_reader@db.example.com/shop?sslmode=verify-full";
        assert_eq!(database_identity("DB", &settings(&[]), Engine::Postgres, url), Ok(None));
        let system =
            database_identity("DB", &settings(&[("DB__credential", "ManagedIdentity")]), Engine::Postgres, url);
        assert_eq!(system, Ok(Some(DatabaseIdentity { setting: "DB__credential".to_string(), client_id: None })));
        let user_assigned = database_identity(
            "DB",
            &settings(&[("DB__credential", "managedidentity"), ("DB__clientId", "1111-2222")]),
            Engine::MySql,
            "mysql://orders_reader@db.example.com/shop",
        )
        .unwrap()
        .unwrap();
        assert_eq!(user_assigned.client_id.as_deref(), Some("1111-2222"));

        let other = database_identity("DB", &settings(&[("DB__credential", "secret")]), Engine::Postgres, url);
        assert!(other.unwrap_err().contains("DB__credential: expected managedidentity"));
        let alone = database_identity("DB", &settings(&[("DB__clientId", "1111")]), Engine::Postgres, url);
        assert!(alone.unwrap_err().contains("DB__clientId is set but DB__credential is not"));
        let with_password = database_identity(
            "DB",
            &settings(&[("DB__credential", "managedidentity")]),
            Engine::Postgres,
            "postgres://orders_reader:hunter2@db.example.com/shop",
        )
        .unwrap_err();
        assert!(with_password.contains("the URL has a password"), "{with_password}");
        assert!(!with_password.contains("hunter2"), "{with_password}");
        let no_user = database_identity(
            "DB",
            &settings(&[("DB__credential", "managedidentity")]),
            Engine::Postgres,
            "postgres://db.example.com/shop",
        )
        .unwrap_err();
        assert!(no_user.contains("the URL names no user"), "{no_user}");
        let sqlite = database_identity(
            "DB",
            &settings(&[("DB__credential", "managedidentity")]),
            Engine::Sqlite,
            "sqlite://x.db",
        );
        assert!(sqlite.unwrap_err().contains("a sqlite file has no login"));
    }
}
