{{- define "kvpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "kvpilot.fullname" -}}
{{- if .Values.fullnameOverride }}{{ .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}{{- $name := include "kvpilot.name" . }}
{{- if contains $name .Release.Name }}{{ .Release.Name | trunc 63 | trimSuffix "-" }}{{ else }}{{ printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}
{{- end -}}

{{/* Labels of the chart's objects. app.kubernetes.io/name is each component's (kvpilot-operator, kvpilot-gateway: what
     selectors, dashboards and `kubectl -l` use, whatever the release is called); part-of is the chart's name. */}}
{{- define "kvpilot.commonLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "kvpilot.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.labels" -}}
app.kubernetes.io/name: kvpilot-operator
{{ include "kvpilot.commonLabels" . }}
{{- end -}}

{{- define "kvpilot.gatewayLabels" -}}
app.kubernetes.io/name: kvpilot-gateway
{{ include "kvpilot.commonLabels" . }}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: kvpilot-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpilot.gatewaySelectorLabels" -}}
app.kubernetes.io/name: kvpilot-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "kvpilot.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end -}}
